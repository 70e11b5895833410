"""Peer implementations used as yardsticks (SGLang's own kernels), imported only when installed."""

"""Small-M linear (``specverify.gemm.skinny_linear``) against an fp64 matmul."""
import pytest
import torch

from specverify.gemm import skinny_linear


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, n, k", [(1, 48, 96), (3, 40, 200), (17, 16, 64)])  # 40/200: ragged N and K tiles;
def test_skinny_linear(device, dtype, m, n, k, poison):                          # 17: two row tiles
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(device)
    out = poison(torch.empty(m, n, dtype=dtype, device=device))
    y = skinny_linear(x, w, out=out, impl="triton")
    want = x.double() @ w.double().t()
    eps = torch.finfo(dtype).eps
    assert y.data_ptr() == out.data_ptr()
    torch.testing.assert_close(y.double(), want, rtol=2 * eps, atol=4 * eps)


@pytest.mark.parametrize("split", [1, 3])
def test_skinny_linear_configs_and_batch_dims(device, split, poison):
    g = torch.Generator().manual_seed(split)
    x = torch.randn(2, 3, 128, generator=g).to(torch.float16).to(device)  # [b, k, K] as the verify pass has it
    w = (torch.randn(32, 128, generator=g) / 11).to(torch.float16).to(device)
    y = skinny_linear(x, w, config={"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": split}, impl="triton")
    assert y.shape == (2, 3, 32)
    torch.testing.assert_close(y.double(), x.double() @ w.double().t(), rtol=2e-3, atol=4e-3)


def test_skinny_linear_errors():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="need x"):
        skinny_linear(x, torch.zeros(4, 9))
    with pytest.raises(TypeError, match="must be bfloat16"):
        skinny_linear(x.long(), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="out must be"):
        skinny_linear(x, torch.zeros(4, 8), out=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="impl must be"):
        skinny_linear(x, torch.zeros(4, 8), impl="cuda")

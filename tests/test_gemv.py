"""The skinny GEMM (``specverify.gemv``) against its fp32 reference, and its bad inputs."""
import pytest
import torch

from specverify.gemv import gemv, gemv_config
from specverify.reference.gemv import gemv_reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m, n, k", [(1, 40, 96), (3, 17, 200), (8, 64, 64), (16, 5, 33)])  # partial tiles
def test_gemv_matches_reference(device, dtype, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = torch.randn(n, k, generator=g).to(dtype).to(device)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    got = gemv(x, w, out=out, impl="triton")
    assert got.data_ptr() == out.data_ptr()
    want = gemv_reference(x, w)
    # one rounding to dtype plus fp32 summation-order noise over k products of unit-variance terms
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got, want, rtol=2 * eps, atol=2 * eps * float(want.abs().max()) + 1e-5 * k ** 0.5)


def test_gemv_strided_rows(device):
    g = torch.Generator().manual_seed(3)
    base = torch.randn(4, 2 * 96, generator=g).to(device)
    x = base[:, :96]  # row stride 192, unit stride on K
    w = torch.randn(24, 96, generator=g).to(device)
    torch.testing.assert_close(gemv(x, w, impl="triton"), gemv_reference(x, w), rtol=1e-5, atol=1e-4)


def test_gemv_config_covers_the_sms_and_fits_registers():
    for m in (1, 2, 4, 8, 16):
        for n in (384, 1536, 2112, 7168):
            c = gemv_config(m, n, 7168, 132)
            assert c["BLOCK_M"] >= m and c["BLOCK_M"] * c["BLOCK_N"] * c["BLOCK_K"] <= 16384
            assert -(-n // c["BLOCK_N"]) >= 2 * 132 or c["BLOCK_N"] == 1


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.zeros(17, 8)), "1..16 rows"),
    (dict(w=torch.zeros(4, 9)), r"\[N, K = 8\]"),
    (dict(w=torch.zeros(4, 8, dtype=torch.float16)), "x's dtype"),
    (dict(x=torch.zeros(2, 8, dtype=torch.int32)), "bf16/fp16/fp32"),
    (dict(x=torch.zeros(8, 2).t()), "unit stride"),
])
def test_gemv_bad_input(bad, match):
    args = dict(x=torch.zeros(2, 8), w=torch.zeros(4, 8))
    args.update(bad)
    with pytest.raises((TypeError, ValueError), match=match):
        gemv(args["x"], args["w"])

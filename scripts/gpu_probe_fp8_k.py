"""Which inner sizes K does `torch._scaled_mm` (cuBLASLt fp8) take on this GPU? The tiny MoE test's
expert down projection (K = 48) failed with CUBLAS_STATUS_NOT_SUPPORTED on an H100 while K = 64 ran;
this prints, per K and per scale layout, whether it runs and how far it lands from an fp32 matmul."""

from __future__ import annotations

import torch


def probe(m: int, n: int, k: int, rowwise: bool, out_dtype: torch.dtype) -> str:
    gen = torch.Generator(device="cuda").manual_seed(k)
    a = torch.randn(m, k, device="cuda", generator=gen)
    b = torch.randn(n, k, device="cuda", generator=gen)
    sa = (a.abs().amax(-1, keepdim=True) if rowwise else a.abs().amax()).float() / 448
    sb = (b.abs().amax(-1, keepdim=True) if rowwise else b.abs().amax()).float() / 448
    qa, qb = (a / sa).to(torch.float8_e4m3fn), (b / sb).to(torch.float8_e4m3fn)
    want = (qa.float() * sa) @ (qb.float() * sb).t()
    try:
        got = torch._scaled_mm(
            qa,
            qb.t(),
            scale_a=sa if rowwise else sa.reshape(()),
            scale_b=sb.t() if rowwise else sb.reshape(()),
            out_dtype=out_dtype,
        )
    except RuntimeError as err:  # the probe reports what the kernel refused
        return f"refused: {str(err).splitlines()[0][:90]}"
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    return f"ran, rel err {err:.1e}"


if __name__ == "__main__":
    print(torch.cuda.get_device_name(0), torch.__version__)
    for k in (16, 32, 48, 64, 80, 96, 128):
        for rowwise in (False, True):
            for out in (torch.float32, torch.bfloat16):
                print(
                    f"K={k:4d} {'rowwise' if rowwise else 'tensor '} out={str(out)[6:]}: "
                    f"{probe(64, 15, k, rowwise, out)}",
                    flush=True,
                )

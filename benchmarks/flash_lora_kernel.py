"""``python -m benchmarks.flash_lora_kernel``: decode/extend timing of the Flash-LoRA-Attention
Triton kernel against its torch reference (CUDA only; moved out of the kernel module)."""

import torch

from sglang_kvshare.kernels.flash_lora_attention import flash_lora_attention_reference, flash_lora_attention_triton


def benchmark(num_req: int = 8, prefix_len: int = 2048, q_len: int = 1, rank: int = 8) -> None:
    """Decode/extend timing of the kernel vs the torch reference (CUDA only)."""
    import triton.testing

    dev, Hq, Hkv, D, n_agents = "cuda", 9, 3, 64, 3
    S = num_req * (prefix_len + q_len)
    k_buf, v_buf = (torch.randn(S, Hkv, D, device=dev, dtype=torch.float16) for _ in range(2))
    lr_buf = torch.randn(S, n_agents, rank, device=dev, dtype=torch.float16)
    B_v = torch.randn(n_agents, rank, Hkv * D, device=dev, dtype=torch.float16) * 0.1
    q = torch.randn(num_req * q_len, Hq, D, device=dev, dtype=torch.float16)
    kv_indices = torch.randperm(S, device=dev, dtype=torch.int64).to(torch.int32)
    qo = torch.arange(num_req + 1, device=dev, dtype=torch.int32) * q_len
    kvp = torch.arange(num_req + 1, device=dev, dtype=torch.int32) * (prefix_len + q_len)
    agent = torch.arange(num_req, device=dev, dtype=torch.int32) % n_agents
    args = (q, k_buf, v_buf, kv_indices, qo, kvp, lr_buf, B_v, agent)
    for name, fn in (("triton", flash_lora_attention_triton), ("torch", flash_lora_attention_reference)):
        ms = triton.testing.do_bench(lambda: fn(*args, max_q_len=q_len))
        print(f"{name:7s} reqs={num_req} prefix={prefix_len} q_len={q_len} r={rank}: {ms:.3f} ms")


if __name__ == "__main__":
    benchmark()
    benchmark(q_len=64)

"""Hardware/model profiles of the vLLM stand-in. See docs/replica-sim.md for the public
figures each number comes from.

Step time (seconds) of one engine iteration (``Profile.step_time_s``) =
    step_fixed_s                                   (weights streamed once per step)
  + prefill_s_per_token   * prefill tokens in the step
  + decode_s_per_seq      * decoding sequences in the step
  + attn_s_per_context_token * context tokens attended by the whole batch
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    step_fixed_s: float
    prefill_s_per_token: float
    decode_s_per_seq: float
    attn_s_per_context_token: float
    block_size: int = 16
    max_model_len: int = 32768
    sources: tuple[str, ...] = ()

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def step_time_s(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        """The cost model of one engine step (before ``--time-scale``)."""
        return (
            self.step_fixed_s
            + self.prefill_s_per_token * prefill_tokens
            + self.decode_s_per_seq * decode_seqs
            + self.attn_s_per_context_token * context_tokens
        )

    def prefill_time_s(self, tokens: int) -> float:
        """Time to first token of a lone request of ``tokens`` uncached prompt tokens: its
        prefill-only steps, chunked by the token budget, costed exactly as the engine
        costs them (a chunk attends its cached context plus half of itself)."""
        total = 0.0
        done = 0
        while True:
            n = min(self.max_num_batched_tokens, tokens - done)
            total += self.step_time_s(n, 0, done + n // 2)
            done += n
            if done >= tokens:
                return total

    def ttft_seed(self, time_scale: float = 1.0) -> tuple[float, float]:
        """(seconds per uncached prompt token, fixed seconds per request): the seed of a
        balancer's TTFT model for replicas of this profile, before it refits online. The
        daemon and the simulator both seed from here, so they start from the same model."""
        per_token = (self.prefill_time_s(1024) - self.prefill_time_s(512)) / 512
        fixed = max(0.0, self.prefill_time_s(512) - per_token * 512)
        return per_token * time_scale, fixed * time_scale


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="l4-llama3.1-8b",
            description="NVIDIA L4 24 GB, Llama-3.1-8B fp16 (SkyWalker's replica setup)",
            # usable 22.5 GiB x 0.95 (--gpu-memory-utilization) - 15.0 GiB of weights
            # - ~0.9 GiB activations/CUDA graphs ≈ 5.5 GiB of KV; Llama-3.1-8B's KV =
            # 32 layers x 8 KV heads x 128 dim x 2 (K,V) x 2 B = 128 KiB/token
            # → ~45k tokens = 2816 blocks of 16 (room for one 32k-token request)
            num_gpu_blocks=2816,
            max_num_seqs=128,
            max_num_batched_tokens=2048,
            # 16.1 GB of weights streamed once per step at ~290 GB/s effective of the
            # L4's 300 GB/s ≈ 55 ms; a 512-token prefill measured ≈ 300 ms (SkyWalker) →
            # (300 - 55) ms / 512 ≈ 0.48 ms per prefill token
            step_fixed_s=0.055,
            prefill_s_per_token=0.00048,
            decode_s_per_seq=0.0004,
            # 128 KiB/token of KV read at 300 GB/s ≈ 0.44 µs per context token per step
            attn_s_per_context_token=4.4e-7,
            max_model_len=32768,
            sources=(
                "SkyWalker (EuroSys'26): L4 replicas serving Llama-3.1-8B, ~300 ms TTFT for 512 tokens",
                "NVIDIA L4 datasheet: 24 GB GDDR6, 300 GB/s, 121 TFLOPS fp16 (sparse 242)",
                "Llama-3.1-8B config: 32 layers, 8 KV heads, head dim 128",
            ),
        ),
        Profile(
            name="h100-qwen2.5-7b",
            description="NVIDIA H100 SXM 80 GB, Qwen2.5-7B-Instruct bf16",
            # 80 GB x 0.9 - 15.2 GB weights - ~4 GB activations ≈ 52 GB KV;
            # Qwen2.5-7B KV = 28 layers x 4 KV heads x 128 dim x 2 x 2 B = 56 KiB/token
            # → ~950k tokens ≈ 59000 blocks of 16
            num_gpu_blocks=59000,
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            # 15.2 GB at 3.35 TB/s ≈ 4.5 ms per memory-bound step
            step_fixed_s=0.005,
            # ~989 TFLOPS bf16 dense at ~45% MFU, 2 x 7.6 GFLOP/token ≈ 34 µs/token;
            # vLLM reports ~15-25k prefill tokens/s for 7B on H100 → 50 µs/token
            prefill_s_per_token=0.00005,
            decode_s_per_seq=0.00008,
            # 56 KiB/token at 3.35 TB/s ≈ 17 ns per context token per step
            attn_s_per_context_token=1.7e-8,
            max_model_len=32768,
            sources=(
                "NVIDIA H100 SXM datasheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOPS bf16 dense",
                "Qwen2.5-7B config: 28 layers, 4 KV heads (GQA), head dim 128",
                "vLLM performance dashboard: 7B-class prefill throughput on H100",
            ),
        ),
        Profile(
            name="tiny-test",
            description="a small, fast engine for tests: 4096-token KV cache",
            num_gpu_blocks=256,
            max_num_seqs=16,
            max_num_batched_tokens=512,
            step_fixed_s=0.002,
            prefill_s_per_token=0.00004,
            decode_s_per_seq=0.0002,
            attn_s_per_context_token=1e-8,
            max_model_len=4096,
            sources=("synthetic: chosen so tests exercise queueing, eviction and preemption quickly",),
        ),
    )
}

"""Hardware/model profiles: what a vLLM replica of a given GPU and model does, by name.
Production reads them for a replica whose config names a profile (``sim.profile``): the
balancer seeds its TTFT model (:meth:`Profile.ttft_seed`) and bounds its upstream
per-token timeout from them, and the config validates the name and sizes a stand-in's
KV-event index. The vLLM stand-in (skymesh/replica_sim) and the discrete-event simulator
run the same cost model; they import it from here, never the other way round. See
docs/replica-sim.md for the public figures each number comes from.

Step time (seconds) of one engine iteration (``Profile.step_time_s``), a roofline:

    max(weight_read_s,                            weights streamed once per step
        compute_s_per_token * tokens in the step)  linear layers: 2 x params FLOP a token
  + prefill_attn_s_per_pair * query-key pairs     prefill attention, quadratic in length
  + attn_s_per_context_token * KV tokens read     decode attention (memory bound)
  + decode_s_per_seq * decoding sequences         per-sequence overhead (sampling, ...)

A step is memory bound (``weight_read_s``) until it carries enough tokens to be compute
bound: a prefill chunk of a few hundred tokens is already past the knee.

``max_num_seqs`` and ``max_num_batched_tokens`` default as vLLM 0.32 defaults them for its
OpenAI server (``EngineArgs.get_batch_defaults``): by the GPU's memory, see
:func:`vllm_batch_defaults`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# total device memory (GiB, as CUDA reports it) from which vLLM 0.32 picks its larger
# batch defaults, and the tier above it (vllm/engine/arg_utils.py, get_batch_defaults)
VLLM_LARGE_GPU_GIB = 70.0
VLLM_HUGE_GPU_GIB = 160.0


def vllm_batch_defaults(gpu_memory_gib: float, gpu_name: str) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) vLLM 0.32's OpenAI server uses when neither
    is given: 1024 / 16384 from 160 GiB of device memory, 1024 / 8192 from 70 GiB (an A100
    excepted: large token budgets slow it down), else 256 / 2048."""
    if gpu_memory_gib >= VLLM_HUGE_GPU_GIB:
        return 1024, 16384
    if gpu_memory_gib >= VLLM_LARGE_GPU_GIB and "a100" not in gpu_name.lower():
        return 1024, 8192
    return 256, 2048


def prefill_pairs(chunk: int, cached: int) -> int:
    """Query-key pairs a prefill chunk of ``chunk`` new tokens attends after ``cached``
    tokens already in the KV cache (causal: new token i sees cached + i + 1 keys)."""
    return chunk * cached + chunk * (chunk + 1) // 2


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    num_gpu_blocks: int
    gpu_name: str
    gpu_memory_gib: float  # total device memory as CUDA reports it (vLLM's batch defaults)
    weight_read_s: float
    compute_s_per_token: float
    prefill_attn_s_per_pair: float
    attn_s_per_context_token: float
    decode_s_per_seq: float
    block_size: int = 16
    max_model_len: int = 32768
    gpu_memory_utilization: float = 0.92  # vLLM 0.32's default; reported in cache_config_info
    # None: vLLM 0.32's default for this GPU (vllm_batch_defaults); a number: as if passed
    # with --max-num-seqs / --max-num-batched-tokens
    max_num_seqs: int = field(default=None)  # type: ignore[assignment]
    max_num_batched_tokens: int = field(default=None)  # type: ignore[assignment]
    sources: tuple[str, ...] = ()
    # KV cache bytes per token (layers x KV heads x head dim x 2 (K and V) x dtype bytes):
    # what a prefill/decode split moves per prompt token
    kv_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        seqs, tokens = vllm_batch_defaults(self.gpu_memory_gib, self.gpu_name)
        if self.max_num_seqs is None:
            object.__setattr__(self, "max_num_seqs", seqs)
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", tokens)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def linear_time_s(self, tokens: int) -> float:
        """The linear layers of one step over ``tokens`` tokens: whichever is slower of
        streaming the weights once and computing 2 x params FLOP per token."""
        return max(self.weight_read_s, self.compute_s_per_token * tokens)

    def step_time_s(self, prefill_tokens: int, decode_seqs: int, context_tokens: int,
                    prefill_attn_pairs: int = 0) -> float:
        """The cost model of one engine step (before ``--time-scale``): ``context_tokens``
        KV tokens read by the decoding sequences, ``prefill_attn_pairs`` query-key pairs
        of the step's prefill chunks (:func:`prefill_pairs`)."""
        return (
            self.linear_time_s(prefill_tokens + decode_seqs)
            + self.prefill_attn_s_per_pair * prefill_attn_pairs
            + self.attn_s_per_context_token * context_tokens
            + self.decode_s_per_seq * decode_seqs
        )

    def prefill_time_s(self, tokens: int) -> float:
        """Time to first token of a lone request of ``tokens`` uncached prompt tokens: its
        prefill-only steps, chunked by the token budget, costed exactly as the engine
        costs them."""
        total = 0.0
        done = 0
        while True:
            n = min(self.max_num_batched_tokens, tokens - done)
            total += self.step_time_s(n, 0, 0, prefill_pairs(n, done))
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


# Roofline inputs (docs/replica-sim.md cites each): dense tensor throughput, memory
# bandwidth, and the model-FLOP utilisation a prefill reaches on that GPU
_L4_FLOPS, _L4_BW, _L4_MFU = 121e12, 300e9, 0.60
_H100_FLOPS, _H100_BW, _H100_MFU = 989e12, 3.35e12, 0.50
# Llama-3.1-8B: 8.03 B params, 32 layers, 32 query heads x 128, 8 KV heads
_LLAMA8B_PARAMS, _LLAMA8B_LAYERS, _LLAMA8B_QDIM, _LLAMA8B_KV_BYTES = 8.03e9, 32, 4096, 32 * 8 * 128 * 2 * 2
# Qwen2.5-7B: 7.61 B params, 28 layers, 28 query heads x 128, 4 KV heads
_QWEN7B_PARAMS, _QWEN7B_LAYERS, _QWEN7B_QDIM, _QWEN7B_KV_BYTES = 7.61e9, 28, 3584, 28 * 4 * 128 * 2 * 2


def _pair_flop(layers: int, qdim: int) -> float:
    # per layer, QK^T and PV each take qdim multiply-adds per query-key pair
    return 4.0 * layers * qdim


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="l4-llama3.1-8b",
            description="NVIDIA L4 24 GB, Llama-3.1-8B fp16 (SkyWalker's replica setup)",
            # usable 22.5 GiB x 0.95 (--gpu-memory-utilization) - 15.0 GiB of weights
            # - ~0.9 GiB activations/CUDA graphs ≈ 5.5 GiB of KV at 128 KiB/token
            # → ~45k tokens = 2816 blocks of 16 (room for one 32k-token request)
            num_gpu_blocks=2816,
            gpu_name="NVIDIA L4",
            gpu_memory_gib=23034 / 1024,  # 23,034 MiB: under 70 GiB → 256 seqs, 2048 tokens
            gpu_memory_utilization=0.95,
            # 16.1 GB of fp16 weights at ~290 GB/s effective of the L4's 300 GB/s
            weight_read_s=0.055,
            # 2 x 8.03 GFLOP per token at 60% of 121 TFLOPS ≈ 0.22 ms per token
            compute_s_per_token=2 * _LLAMA8B_PARAMS / (_L4_FLOPS * _L4_MFU),
            # 524k FLOP per query-key pair at 60% of 121 TFLOPS ≈ 7.2 ns
            prefill_attn_s_per_pair=_pair_flop(_LLAMA8B_LAYERS, _LLAMA8B_QDIM) / (_L4_FLOPS * _L4_MFU),
            # 128 KiB of KV per context token read at 300 GB/s ≈ 0.44 µs per step
            attn_s_per_context_token=_LLAMA8B_KV_BYTES / _L4_BW,
            kv_bytes_per_token=_LLAMA8B_KV_BYTES,
            decode_s_per_seq=5e-5,  # assumed: sampling and bookkeeping per sequence
            max_model_len=32768,
            sources=(
                "NVIDIA L4 datasheet: 24 GB GDDR6, 300 GB/s, 121 TFLOPS fp16 tensor dense (242 sparse)",
                "Llama-3.1-8B config.json: 32 layers, 32 heads, 8 KV heads, head dim 128; 8.03 B params",
                "vLLM 0.32 engine/arg_utils.py get_batch_defaults: < 70 GiB → max_num_seqs 256, 2048 tokens",
            ),
        ),
        Profile(
            name="h100-qwen2.5-7b",
            description="NVIDIA H100 SXM 80 GB, Qwen2.5-7B-Instruct bf16",
            # 80 GB x 0.9 - 15.2 GB weights - ~4 GB activations ≈ 52 GB KV at 56 KiB/token
            # → ~950k tokens ≈ 59000 blocks of 16
            num_gpu_blocks=59000,
            gpu_name="NVIDIA H100 80GB HBM3",
            gpu_memory_gib=81559 / 1024,  # 81,559 MiB: over 70 GiB → 1024 seqs, 8192 tokens
            gpu_memory_utilization=0.9,
            # 15.2 GB at 3.35 TB/s ≈ 4.5 ms per memory-bound step (5 ms with overhead)
            weight_read_s=0.005,
            # 2 x 7.61 GFLOP per token at 50% of 989 TFLOPS ≈ 31 µs per token
            compute_s_per_token=2 * _QWEN7B_PARAMS / (_H100_FLOPS * _H100_MFU),
            # 401k FLOP per query-key pair at 50% of 989 TFLOPS ≈ 0.81 ns
            prefill_attn_s_per_pair=_pair_flop(_QWEN7B_LAYERS, _QWEN7B_QDIM) / (_H100_FLOPS * _H100_MFU),
            # 56 KiB/token of KV at 3.35 TB/s ≈ 17 ns per context token per step
            attn_s_per_context_token=_QWEN7B_KV_BYTES / _H100_BW,
            kv_bytes_per_token=_QWEN7B_KV_BYTES,
            decode_s_per_seq=2e-5,  # assumed: sampling and bookkeeping per sequence
            max_model_len=32768,
            sources=(
                "NVIDIA H100 SXM datasheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOPS bf16 tensor dense",
                "Qwen2.5-7B config.json: 28 layers, 28 heads, 4 KV heads (GQA), head dim 128; 7.61 B params",
                "vLLM 0.32 engine/arg_utils.py get_batch_defaults: >= 70 GiB → max_num_seqs 1024, 8192 tokens",
            ),
        ),
        Profile(
            name="tiny-test",
            description="a small, fast engine for tests: 4096-token KV cache",
            num_gpu_blocks=256,
            gpu_name="synthetic",
            gpu_memory_gib=24.0,
            # synthetic limits, as if given with --max-num-seqs / --max-num-batched-tokens
            max_num_seqs=16,
            max_num_batched_tokens=512,
            weight_read_s=0.002,
            compute_s_per_token=0.00004,
            prefill_attn_s_per_pair=1e-11,
            attn_s_per_context_token=1e-8,
            kv_bytes_per_token=4096,  # synthetic: a small model's KV
            decode_s_per_seq=0.0002,
            max_model_len=4096,
            sources=("synthetic: chosen so tests exercise queueing, eviction and preemption quickly",),
        ),
    )
}

"""Known accelerators: dense bf16 peak, memory and link speeds, for MFU and for the planner; and the share of this
machine's CPU that one process of a CPU rehearsal gets.

Peaks are the vendors' dense (not sparse) bf16/fp16 tensor-core numbers, and their FP8 ones (twice bf16's on Hopper,
Blackwell, CDNA3 and Ada; Ampere has no FP8 tensor cores). Link speeds are per GPU and per
direction: NVLink (Infinity Fabric on AMD) inside a node, the InfiniBand/RoCE share of one GPU between nodes.

Memory is what PyTorch reports as the device's total (``torch.cuda.get_device_properties().total_memory``, the
"total capacity" of its out-of-memory messages) in GB of 10^9 bytes, as a launch plans with it
(`strategies.auto_layout`): a datasheet's "80 GB" of HBM is 80 GiB, of which the driver keeps a little, so an H100
holds 79.19 GiB = 85.0 GB (nvidia-smi: 81,559 MiB).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from lit3d.planner.calibration import ADA, AMPERE, BLACKWELL, CDNA3, CPU, HOPPER, Efficiencies


@dataclass(frozen=True)
class GPU:
    name: str
    peak_tflops: float  # dense bf16 (fp32 for a CPU, which lit3d runs in fp32)
    memory_gb: float
    intra_node_gbps: float  # GB/s per direction (NVLink)
    inter_node_gbps: float  # GB/s per GPU between nodes
    memory_bandwidth_gbps: float  # HBM (a CPU's DRAM), GB/s
    tdp_watts: float = 700.0  # the board power its peak and `efficiency` are rated at
    efficiency: Efficiencies = HOPPER  # how close its kernels come to the numbers above (`lit3d.planner.calibration`)
    device: str = "GPU"  # what the planner's reports call one of them
    fp8_tflops: float = 0.0  # dense FP8 tensor-core peak; 0: no FP8 tensor cores (FP8 matmuls run at `peak_tflops`)


# Memory (GB) as PyTorch reports it, from its out-of-memory messages and nvidia-smi's totals in public logs naming the
# card: B200 178.35 GiB (183,359 MiB), GB200 184.31 GiB (189,471 MiB), H200 and H200 NVL 139.8 GiB (143,771 MiB),
# H100 SXM and PCIe 79.19 GiB (81,559 MiB), H100 NVL 93.1 GiB (95,830 MiB), GH200 96 GB 94.5 GiB (97,871 MiB; Meta's
# H100 96GB boards assumed the same), A100 80GB 79.15 GiB (81,920 MiB), A100 40GB 39.49 GiB (40,960 MiB), MI300X
# 191.98 GiB, L40S 44.4 GiB (46,068 MiB), A10G 21.99 GiB (23,028 MiB). It moves by about 0.1 GiB between drivers.
GPUS: dict[str, GPU] = {
    # NVIDIA B200 (HGX B200, 1,000 W): HGX B200 datasheet / Blackwell architecture technical brief: 2.25 PFLOP/s
    # dense BF16 (4.5 with sparsity), 180 GB HBM3e at 8 TB/s, NVLink 5 at 1.8 TB/s both directions; DGX B200 gives
    # each GPU one 400 Gb/s ConnectX-7 port.
    "B200": GPU("B200", 2250.0, 191.5, 900.0, 50.0, 8000.0, 1000.0, BLACKWELL, fp8_tflops=4500.0),
    # NVIDIA GB200 (GB200 NVL72, 1,200 W per GPU): GB200 NVL72 datasheet: 360 PFLOP/s sparse BF16 over 72 GPUs = 2.5
    # dense each, 13.4 TB HBM3e at 576 TB/s = 186 GB at 8 TB/s each, NVLink 5 at 1.8 TB/s both directions (one
    # NVLink domain is the 72-GPU rack: plan it with --gpus_per_node 72); 400 Gb/s ConnectX-7 per GPU.
    "GB200": GPU("GB200", 2500.0, 197.9, 900.0, 50.0, 8000.0, 1200.0, BLACKWELL, fp8_tflops=5000.0),
    # NVIDIA H200 SXM datasheet (up to 700 W): 989 TFLOP/s dense BF16, 141 GB HBM3e at 4.8 TB/s, NVLink 4 at 900 GB/s
    # both ways.
    "H200": GPU("H200", 989.0, 150.1, 450.0, 50.0, 4800.0, 700.0, HOPPER, fp8_tflops=1979.0),
    # NVIDIA H100 SXM datasheet (up to 700 W): 989 TFLOP/s dense BF16, 80 GB HBM3 at 3.35 TB/s, NVLink 4 at 900 GB/s
    # both ways.
    "H100": GPU("H100", 989.0, 85.0, 450.0, 50.0, 3350.0, 700.0, HOPPER, fp8_tflops=1979.0),
    # NVIDIA H800 SXM (the H100 sold in China, 700 W): an H100's compute and 80 GB HBM3 at 3.35 TB/s, NVLink cut to
    # 400 GB/s both ways; DeepSeek-V3's report (2,048 of them, 8 a node) measured 160 GB/s of it and 50 GB/s of
    # InfiniBand per GPU between nodes.
    "H800": GPU("H800", 989.0, 85.0, 200.0, 50.0, 3350.0, 700.0, HOPPER, fp8_tflops=1979.0),
    # H100 SXM boards with 96 GB of HBM2e at 2.4 TB/s (Meta's Grand Teton hosts, torchtitan's benchmarks: "96GB HBM2e
    # with 2.4 TB/sec peak memory bandwidth", run at a 500 W limit of 700).
    "H100 96GB": GPU("H100 96GB", 989.0, 101.5, 450.0, 50.0, 2400.0, 700.0, HOPPER, fp8_tflops=1979.0),
    # NVIDIA H100 NVL/PCIe datasheet (PCIe: 300-350 W): 756 TFLOP/s dense BF16 (PCIe), 80 GB HBM2e at 2 TB/s,
    # NVLink bridge 600 GB/s.
    "H100 PCIe": GPU("H100 PCIe", 756.0, 85.0, 300.0, 50.0, 2000.0, 350.0, HOPPER, fp8_tflops=1513.0),
    # The same datasheet's H100 NVL (350-400 W): 1,671 TFLOP/s BF16 with sparsity (835.5 dense), 94 GB HBM3 at
    # 3.9 TB/s, NVLink bridge 600 GB/s.
    "H100 NVL": GPU("H100 NVL", 835.5, 100.0, 300.0, 50.0, 3900.0, 400.0, HOPPER, fp8_tflops=1671.0),
    # NVIDIA H200 NVL (PCIe card, up to 600 W), H200 datasheet: 1,671 TFLOP/s BF16 with sparsity (835.5 dense), 141 GB
    # HBM3e at 4.8 TB/s, NVLink bridge 900 GB/s.
    "H200 NVL": GPU("H200 NVL", 835.5, 150.1, 450.0, 50.0, 4800.0, 600.0, HOPPER, fp8_tflops=1671.0),
    # NVIDIA GH200 Grace Hopper (`get_device_name()`: "NVIDIA GH200 480GB"): an H100's compute (989 TFLOP/s dense
    # BF16) with 96 GB HBM3 at 4 TB/s, NVLink 4 at 900 GB/s both ways (GH200 datasheet; rated here as the H100 SXM).
    "GH200": GPU("GH200", 989.0, 101.5, 450.0, 50.0, 4000.0, 700.0, HOPPER, fp8_tflops=1979.0),
    # NVIDIA A100 SXM datasheet (400 W): 312 TFLOP/s dense BF16, 80 GB HBM2e at 2,039 GB/s (40 GB: 1,555), NVLink 3
    # 600 GB/s.
    "A100": GPU("A100", 312.0, 85.0, 300.0, 25.0, 2039.0, 400.0, AMPERE),
    "A100 40GB": GPU("A100 40GB", 312.0, 42.4, 300.0, 25.0, 1555.0, 400.0, AMPERE),
    # AMD Instinct MI300X data sheet (750 W): 1,307.4 TFLOP/s dense BF16 (2,614.9 with sparsity), 192 GB HBM3 at
    # 5.3 TB/s;
    # Infinity Fabric: each GPU reaches the other 7 of the platform over one 128 GB/s (both ways) link each:
    # 7 x 64 = 448 GB/s per direction. A 400 Gb/s NIC per GPU between nodes.
    "MI300X": GPU("MI300X", 1307.4, 206.1, 448.0, 50.0, 5300.0, 750.0, CDNA3, fp8_tflops=2614.9),
    # NVIDIA L40S datasheet (350 W): 362 TFLOP/s dense BF16, 48 GB GDDR6 at 864 GB/s, PCIe 4 (no NVLink).
    "L40S": GPU("L40S", 362.0, 47.7, 32.0, 25.0, 864.0, 350.0, ADA, fp8_tflops=733.0),
    # NVIDIA A10G (AWS G5, 300 W): 125 TFLOP/s dense BF16, 24 GB GDDR6 at 600 GB/s, PCIe 4.
    "A10G": GPU("A10G", 125.0, 23.6, 32.0, 12.5, 600.0, 300.0, ADA),
    # One process of a CPU rehearsal, on one core (stated, not measured): a 2020s x86 core at ~3 GHz with AVX2's two
    # 8-lane fp32 FMA units does 32 FLOP per cycle, ~0.1 TFLOP/s fp32; an 8-core laptop's 32 GB and ~80 GB/s of
    # dual-channel DDR5 shared by 8; gloo between processes over shared memory, a few GB/s; 10 Gb/s Ethernet between
    # machines. `cpu_share` fits it to this machine.
    "CPU": GPU("CPU", 0.096, 4.0, 5.0, 1.25, 10.0, efficiency=CPU, device="CPU process"),
}


def cpu_share(processes: int, cores: int | None = None, memory_gb: float | None = None) -> GPU:
    """What each of ``processes`` CPU processes gets of this machine: its cores' peak (``GPUS["CPU"]`` per core) and
    its memory, divided among them. ``cores`` and ``memory_gb`` default to this machine's (counted, not measured)."""
    if processes < 1:
        raise ValueError(f"processes={processes} must be a positive integer")
    cores = cores or os.cpu_count() or 1
    if memory_gb is None:
        try:
            memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
        except (ValueError, OSError, AttributeError):  # NOTE: no sysconf (Windows): a laptop's 16 GB
            memory_gb = 16.0
    # NOTE: Lightning gives each of its CPU processes cores / processes threads (`_set_num_threads_if_needed`).
    core, share = GPUS["CPU"], cores / processes
    return replace(
        core,
        peak_tflops=core.peak_tflops * share,
        memory_gb=round(memory_gb / processes, 1),
        memory_bandwidth_gbps=core.memory_bandwidth_gbps * share,
    )


def identify(device_name: str) -> GPU | None:
    """The table entry for a CUDA (or ROCm) device name (``torch.cuda.get_device_name()``: "NVIDIA H100 80GB HBM3",
    "NVIDIA H100 NVL", "NVIDIA A100-SXM4-40GB", "AMD Instinct MI300X", ...), or None when unknown: an unknown device
    gets no MFU rather than a wrong one (`unknown_device` says so by name)."""
    name = device_name.upper()
    # NOTE: the more specific names first: "GB200" holds "B200", "GH200" and "H200 NVL" hold "H200".
    if "GB200" in name:
        return GPUS["GB200"]
    if "B200" in name:
        return GPUS["B200"]
    if "MI300X" in name:
        return GPUS["MI300X"]
    if "GH200" in name:
        return GPUS["GH200"]
    if "H200" in name:
        return GPUS["H200 NVL"] if "NVL" in name else GPUS["H200"]
    if "H800" in name:
        return GPUS["H800"]
    if "H100" in name:
        return GPUS["H100 NVL"] if "NVL" in name else GPUS["H100 PCIe"] if "PCIE" in name else GPUS["H100"]
    if "A100" in name:
        return GPUS["A100 40GB"] if "40GB" in name else GPUS["A100"]
    for key in ("L40S", "A10G"):
        if key in name:
            return GPUS[key]
    return None


def unknown_device(device_name: str) -> str:
    """What to say of a device `identify` does not know: its name, and the names it does."""
    return (
        f"the device {device_name!r} is not in lit3d's GPU table (lit3d/planner/hardware.py knows {', '.join(GPUS)}): "
        "no MFU, and the planner needs its numbers given (--gpu_memory, --peak_tflops, the bandwidths)"
    )

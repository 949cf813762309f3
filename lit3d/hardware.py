"""Known accelerators: dense bf16 peak, memory and link speeds, for MFU and for the planner.

Peaks are the vendors' dense (not sparse) bf16/fp16 tensor-core numbers. Link speeds are per GPU and per
direction: NVLink inside a node, the InfiniBand/RoCE share of one GPU between nodes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    peak_tflops: float  # dense bf16
    memory_gb: float
    intra_node_gbps: float  # GB/s per direction (NVLink)
    inter_node_gbps: float  # GB/s per GPU between nodes


GPUS: dict[str, GPU] = {
    "H200": GPU("H200", 989.0, 141.0, 450.0, 50.0),
    "H100": GPU("H100", 989.0, 80.0, 450.0, 50.0),
    "H100 PCIe": GPU("H100 PCIe", 756.0, 80.0, 300.0, 50.0),
    "A100": GPU("A100", 312.0, 80.0, 300.0, 25.0),
    "A100 40GB": GPU("A100 40GB", 312.0, 40.0, 300.0, 25.0),
    "L40S": GPU("L40S", 362.0, 48.0, 32.0, 25.0),
    "A10G": GPU("A10G", 125.0, 24.0, 32.0, 12.5),
}


def identify(device_name: str) -> GPU | None:
    """The table entry for a CUDA device name (``torch.cuda.get_device_name()``), or None when unknown: an
    unknown device gets no MFU rather than a wrong one."""
    name = device_name.upper()
    if "H200" in name:
        return GPUS["H200"]
    if "H100" in name:
        return GPUS["H100 PCIe"] if "PCIE" in name else GPUS["H100"]
    if "A100" in name:
        return GPUS["A100 40GB"] if "40GB" in name else GPUS["A100"]
    for key in ("L40S", "A10G"):
        if key in name:
            return GPUS[key]
    return None

"""Peak dense tensor-core throughput per GPU model: the denominator of MFU.

MFU = achieved model FLOP/s ÷ peak dense FLOP/s of the rank's GPU for the training dtype
(PaLM, Chowdhery et al. 2022, appendix B). The table is keyed by the PCI device id that
``nvmlDeviceGetPciInfo().pciDeviceId`` reports (upper 16 bits; vendor 0x10de in the lower 16)
and, for parts whose id we could not verify, by the exact ``nvmlDeviceGetName`` string. Never
by substring: ``"L4" in "NVIDIA L40S"`` is how other tools got MFU wrong.

Values are FLOP/s per GPU from NVIDIA's datasheets (``source``). Datasheets print the 2:4
structured-sparsity figure with an asterisk; the ``dense`` values below are those figures
halved, and ``sparse`` keeps the printed figure, so the two are never confused. A model or
dtype that is not in the table gets no MFU and a reason (docs/metrics.md), never another GPU's
peak. ``TRAINMON_PEAK_FLOPS`` overrides the table for every GPU of the node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DTYPES = ("bf16", "fp16", "fp8", "tf32")
"""Training dtypes the table knows (the client's ``dtype`` option)."""

T = 1e12


@dataclass(frozen=True)
class GpuModel:
    """One GPU model: dense peak FLOP/s per dtype and where the numbers come from."""

    model: str
    dense: dict[str, float]
    source: str
    pci_device_ids: tuple[int, ...] = ()
    names: tuple[str, ...] = ()

    @property
    def sparse(self) -> dict[str, float]:
        """2:4 structured-sparsity peaks, as datasheets print them (2 × dense)."""
        return {k: 2 * v for k, v in self.dense.items() if k != "fp32"}


MODELS: tuple[GpuModel, ...] = (
    GpuModel(
        "A100",
        {"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T},
        "NVIDIA A100 Tensor Core GPU datasheet (2021): BF16/FP16 312 TF, TF32 156 TF dense",
        (0x20B0, 0x20B2, 0x20B5, 0x20F1, 0x20F3),
        (
            "NVIDIA A100-SXM4-40GB",
            "NVIDIA A100-SXM4-80GB",
            "NVIDIA A100-PCIE-40GB",
            "NVIDIA A100 80GB PCIe",
            "NVIDIA A800-SXM4-80GB",
        ),
    ),
    GpuModel(
        "H100 SXM",
        {"bf16": 989.5 * T, "fp16": 989.5 * T, "fp8": 1979 * T, "tf32": 494.5 * T},
        "NVIDIA H100 datasheet, SXM column: BF16 1,979 TF*, FP8 3,958 TF*, TF32 989 TF* "
        "(* with sparsity)",
        (0x2330, 0x2324),
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5 80GB", "NVIDIA H800"),
    ),
    GpuModel(
        "H100 PCIe",
        {"bf16": 756.5 * T, "fp16": 756.5 * T, "fp8": 1513 * T, "tf32": 378 * T},
        "NVIDIA H100 datasheet, PCIe column: BF16 1,513 TF*, FP8 3,026 TF*, TF32 756 TF*",
        (0x2331, 0x2322),
        ("NVIDIA H100 PCIe", "NVIDIA H800 PCIe"),
    ),
    GpuModel(
        "H100 NVL",
        {"bf16": 835.5 * T, "fp16": 835.5 * T, "fp8": 1670.5 * T, "tf32": 417.5 * T},
        "NVIDIA H100 datasheet, NVL column (per GPU): BF16 1,671 TF*, FP8 3,341 TF*, TF32 835 TF*",
        (0x2321,),
        ("NVIDIA H100 NVL",),
    ),
    GpuModel(
        "H200 SXM",
        {"bf16": 989.5 * T, "fp16": 989.5 * T, "fp8": 1979 * T, "tf32": 494.5 * T},
        "NVIDIA H200 datasheet, SXM column: BF16 1,979 TF*, FP8 3,958 TF*, TF32 989 TF*",
        (0x2335,),
        ("NVIDIA H200",),
    ),
    GpuModel(
        "H200 NVL",
        {"bf16": 835.5 * T, "fp16": 835.5 * T, "fp8": 1670.5 * T, "tf32": 417.5 * T},
        "NVIDIA H200 datasheet, NVL column: BF16 1,671 TF*, FP8 3,341 TF*, TF32 835 TF*",
        (),
        ("NVIDIA H200 NVL",),
    ),
    GpuModel(
        "H20",
        {"bf16": 148 * T, "fp16": 148 * T, "fp8": 296 * T, "tf32": 74 * T},
        "NVIDIA H20 product brief: BF16/FP16 148 TF, FP8 296 TF, TF32 74 TF dense",
        (),
        ("NVIDIA H20",),
    ),
    GpuModel(
        "B200",
        {"bf16": 2250 * T, "fp16": 2250 * T, "fp8": 4500 * T, "tf32": 1100 * T},
        "NVIDIA HGX B200 datasheet (per GPU): BF16 4.5 PF*, FP8 9 PF*, TF32 2.2 PF*",
        (),
        ("NVIDIA B200",),
    ),
    GpuModel(
        "GB200",
        {"bf16": 2500 * T, "fp16": 2500 * T, "fp8": 5000 * T, "tf32": 1250 * T},
        "NVIDIA GB200 NVL72 datasheet, per GB200 superchip (2 GPUs): BF16 10 PF*, FP8 20 PF*, "
        "TF32 5 PF*; halved per GPU",
        (),
        ("NVIDIA GB200",),
    ),
    GpuModel(
        "L40S",
        {"bf16": 362.05 * T, "fp16": 362.05 * T, "fp8": 733 * T, "tf32": 183 * T},
        "NVIDIA L40S datasheet: BF16 362.05 | 733 TF*, FP8 733 | 1,466 TF*, TF32 183 | 366 TF*",
        (),
        ("NVIDIA L40S",),
    ),
    GpuModel(
        "L40",
        {"bf16": 181.05 * T, "fp16": 181.05 * T, "fp8": 362 * T, "tf32": 90.5 * T},
        "NVIDIA L40 datasheet: BF16 181.05 | 362.1 TF*, FP8 362 | 724 TF*, TF32 90.5 | 181 TF*",
        (0x26B5,),
        ("NVIDIA L40",),
    ),
    GpuModel(
        "L4",
        {"bf16": 121 * T, "fp16": 121 * T, "fp8": 242.5 * T, "tf32": 60 * T},
        "NVIDIA L4 datasheet: BF16 242 TF*, FP8 485 TF*, TF32 120 TF*",
        (0x27B8,),
        ("NVIDIA L4",),
    ),
    GpuModel(
        "A10G",
        {"bf16": 125 * T, "fp16": 125 * T, "tf32": 62.5 * T},
        "NVIDIA A10 datasheet (BF16 125 | 250 TF*, TF32 62.5 | 125 TF*): NVIDIA publishes no "
        "A10G sheet; AWS's A10G is the same GA102 part and this is its upper bound",
        (0x2237,),
        ("NVIDIA A10G",),
    ),
    GpuModel(
        "A10",
        {"bf16": 125 * T, "fp16": 125 * T, "tf32": 62.5 * T},
        "NVIDIA A10 datasheet: BF16 125 | 250 TF*, TF32 62.5 | 125 TF*",
        (0x2236,),
        ("NVIDIA A10",),
    ),
    GpuModel(
        "RTX 4090",
        {"bf16": 165.2 * T, "fp16": 165.2 * T, "fp8": 330.3 * T, "tf32": 82.6 * T},
        "NVIDIA Ada GPU architecture whitepaper, appendix A (RTX 4090): BF16/FP16 with FP32 "
        "accumulate 165.2 TF, FP8 with FP32 accumulate 330.3 TF, TF32 82.6 TF dense",
        (0x2684,),
        ("NVIDIA GeForce RTX 4090",),
    ),
)

_BY_ID: dict[int, GpuModel] = {i: m for m in MODELS for i in m.pci_device_ids}
_BY_NAME: dict[str, GpuModel] = {n.casefold(): m for m in MODELS for n in m.names}
_SPACES = re.compile(r"\s+")


@dataclass(frozen=True)
class Peak:
    """The outcome of a lookup: ``flops`` (dense FLOP/s) or ``reason`` why there is none."""

    flops: float | None
    model: str = ""
    reason: str = ""


def find_model(name: str, pci_device_id: int | None = None) -> GpuModel | None:
    """The table entry for a GPU: by PCI device id first, then by exact NVML name.

    ``pci_device_id`` is NVML's ``pciDeviceId`` (device << 16 | vendor 0x10de).
    """
    if pci_device_id is not None and (pci_device_id & 0xFFFF) == 0x10DE:
        model = _BY_ID.get(pci_device_id >> 16)
        if model is not None:
            return model
    return _BY_NAME.get(_SPACES.sub(" ", name.strip()).casefold())


def peak_flops(
    name: str, pci_device_id: int | None, dtype: str, override: float | None = None
) -> Peak:
    """Dense peak FLOP/s of one GPU for ``dtype``, or a reason there is none.

    Reasons: ``unknown_gpu_model`` (not in the table: set ``TRAINMON_PEAK_FLOPS``) and
    ``unknown_dtype`` (the model has no tensor-core rate for that dtype, e.g. FP8 on A100).
    """
    if override is not None:
        return Peak(override, "override")
    model = find_model(name, pci_device_id)
    if model is None:
        return Peak(None, reason="unknown_gpu_model")
    flops = model.dense.get(dtype)
    if flops is None:
        return Peak(None, model.model, "unknown_dtype")
    return Peak(flops, model.model)


@dataclass(frozen=True)
class Mfu:
    """One rank's MFU figures; ``reason`` says why ``mfu`` is None (docs/metrics.md)."""

    model_flops: float | None = None
    peak: float | None = None
    mfu: float | None = None
    reason: str = ""


def rank_mfu(
    tokens_per_second: float | None,
    flops_per_token: float | None,
    dtype: str,
    gpu_uuid: str | None,
    gpu: tuple[str, int] | None,
    override: float | None = None,
) -> Mfu:
    """MFU of one rank (PaLM, Chowdhery et al. 2022, appendix B).

    ``model_flops = tokens_per_second × flops_per_token``; ``mfu = model_flops / peak`` with
    ``peak`` the dense FLOP/s of the rank's GPU for ``dtype``. ``gpu`` is the sampled GPU
    whose UUID is ``gpu_uuid``, as (NVML name, pciDeviceId), or None when NVML does not show
    it. Reasons: ``no_flops_per_token``, ``no_gpu_uuid``, ``gpu_not_sampled``,
    ``unknown_gpu_model``, ``unknown_dtype``.
    """
    if flops_per_token is None:
        return Mfu(reason="no_flops_per_token")
    achieved = None if tokens_per_second is None else tokens_per_second * flops_per_token
    if override is not None:
        p = Peak(override, "override")
    elif not gpu_uuid:
        return Mfu(achieved, reason="no_gpu_uuid")
    elif gpu is None:
        return Mfu(achieved, reason="gpu_not_sampled")
    else:
        p = peak_flops(gpu[0], gpu[1], dtype)
    if p.flops is None:
        return Mfu(achieved, reason=p.reason)
    return Mfu(achieved, p.flops, None if achieved is None else achieved / p.flops)

//! GPUs: the capacity PyTorch sees (`torch.cuda.mem_get_info()` total), the memory a process
//! holds outside the caching allocator (CUDA context, kernels, the first small segment), as
//! `total - free` right after `torch.zeros(1, device="cuda")`, and the constants that depend on
//! the GPU's architecture: the cuBLAS and cuBLASLt workspaces PyTorch allocates through the
//! caching allocator, and which attention kernels exist.

use serde::Serialize;

use crate::error::{Error, Result};
use crate::units::{from_gib, parse_size};

/// A GPU architecture, as far as the memory model cares: it sets the library workspaces
/// (`aten/src/ATen/cuda/CublasHandlePool.cpp` keys them on the compute capability, or on the
/// gfx target under ROCm) and the attention kernels SDPA can pick.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuArch {
    /// sm70 (V100): no FlashAttention, no cuDNN attention.
    Volta,
    /// sm80 and sm86 (A100, A10G, RTX 3090).
    Ampere,
    /// sm89 (L40S, RTX 4090).
    Ada,
    /// sm90 (H100, H200): what every constant was measured on.
    Hopper,
    /// gfx942 (MI300X), PyTorch's ROCm build.
    Cdna3,
}

/// The workspaces PyTorch's BLAS handles take from the caching allocator, each once per
/// (thread, stream) at the first GEMM that needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Workspaces {
    /// `getChosenWorkspaceSize()`: the cuBLAS (hipBLAS) workspace of every GEMM's handle.
    pub cublas_bytes: u64,
    /// `getCUDABlasLtWorkspaceSize()`: cuBLASLt's (hipBLASLt's), for `addmm` with a bias
    /// epilogue.
    pub cublaslt_bytes: u64,
    /// Streaming multiprocessors: how many blocks a reduction kernel aims for
    /// (`setReduceConfig`'s `target_grid_size`), which sizes its global staging buffer.
    pub multiprocessors: u64,
}

/// PyTorch 2.11's default cuBLAS workspace off sm90 (`parseChosenWorkspaceSize`: the
/// `:4096:2:16:8` of `CUBLAS_WORKSPACE_CONFIG`, two 4 MiB and eight 16 KiB chunks). Blackwell
/// (sm100, sm120) gets it too in 2.11; the 32 MiB for majors 10 and 12 came after
/// (pytorch/pytorch#175344).
const CUBLAS_DEFAULT: u64 = 2 * (4096 << 10) + 8 * (16 << 10);

/// `parseCUDABlasLtWorkspaceSize`'s default, 1024 KiB (pytorch/pytorch#73328), capped at the
/// cuBLAS workspace (`getCUDABlasLtWorkspaceSize`), which is larger on every NVIDIA GPU.
const CUBLASLT_DEFAULT: u64 = 1 << 20;

impl GpuArch {
    /// How it is named in reports.
    pub fn key(self) -> &'static str {
        match self {
            GpuArch::Volta => "volta",
            GpuArch::Ampere => "ampere",
            GpuArch::Ada => "ada",
            GpuArch::Hopper => "hopper",
            GpuArch::Cdna3 => "cdna3",
        }
    }

    /// The compute capability or gfx target the workspace rule reads.
    pub fn target(self) -> &'static str {
        match self {
            GpuArch::Volta => "sm70",
            GpuArch::Ampere => "sm80/sm86",
            GpuArch::Ada => "sm89",
            GpuArch::Hopper => "sm90",
            GpuArch::Cdna3 => "gfx942",
        }
    }

    /// The workspaces of PyTorch 2.11 on this architecture, with the environment variables
    /// (`CUBLAS_WORKSPACE_CONFIG`, `CUBLASLT_WORKSPACE_SIZE`) unset.
    pub fn workspaces(self) -> Workspaces {
        match self {
            // `parseChosenWorkspaceSize`: 32 MiB when `major == 9 && minor == 0`.
            // H100 SXM and H200: 132 SMs.
            GpuArch::Hopper => Workspaces {
                cublas_bytes: 32 << 20,
                cublaslt_bytes: CUBLASLT_DEFAULT,
                multiprocessors: 132,
            },
            // V100 80, A100 108, L40S 142.
            GpuArch::Volta | GpuArch::Ampere | GpuArch::Ada => Workspaces {
                cublas_bytes: CUBLAS_DEFAULT,
                cublaslt_bytes: CUBLASLT_DEFAULT,
                multiprocessors: match self {
                    GpuArch::Volta => 80,
                    GpuArch::Ampere => 108,
                    _ => 142,
                },
            },
            // ROCm: 128 MiB of hipBLAS workspace on gfx94x/gfx95x (32 MiB elsewhere), and
            // `parseCUDABlasLtWorkspaceSize`'s 76 MiB for hipBLASLt, not capped.
            // MI300X: 304 compute units.
            GpuArch::Cdna3 => Workspaces {
                cublas_bytes: 128 << 20,
                cublaslt_bytes: 76 << 20,
                multiprocessors: 304,
            },
        }
    }

    /// Where [`GpuArch::workspaces`] comes from, in words.
    pub fn workspace_source(self) -> &'static str {
        match self {
            GpuArch::Hopper => {
                "PyTorch 2.11's CublasHandlePool.cpp on sm90 (parseChosenWorkspaceSize: 32 MiB; \
                 getCUDABlasLtWorkspaceSize: 1 MiB), as measured on the H100 and H200"
            }
            GpuArch::Volta | GpuArch::Ampere | GpuArch::Ada => {
                "PyTorch 2.11's CublasHandlePool.cpp off sm90 (parseChosenWorkspaceSize: \
                 :4096:2:16:8; getCUDABlasLtWorkspaceSize: 1 MiB); not measured"
            }
            GpuArch::Cdna3 => {
                "PyTorch 2.11's CublasHandlePool.cpp under ROCm on gfx94x \
                 (parseChosenWorkspaceSize: 128 MiB; parseCUDABlasLtWorkspaceSize: 76 MiB); \
                 not measured"
            }
        }
    }

    /// Whether SDPA's FlashAttention and cuDNN kernels run here (both need sm80 or later;
    /// `sdp_utils.cpp`, `check_sm_version`).
    pub fn has_flash_attention(self) -> bool {
        !matches!(self, GpuArch::Volta)
    }
}

/// How a constant of a GPU is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Basis {
    /// Read on this GPU by the measuring harness.
    Measured,
    /// The total PyTorch printed in an out-of-memory message on this GPU.
    OomMessage,
    /// Read from PyTorch's source for this architecture.
    PytorchSource,
    /// Measured on another GPU (the H200) and used here as it is.
    CarriedOver,
    /// Given by the user (`--gpu 64GiB`).
    Given,
}

impl Basis {
    pub fn key(self) -> &'static str {
        match self {
            Basis::Measured => "measured",
            Basis::OomMessage => "oom_message",
            Basis::PytorchSource => "pytorch_source",
            Basis::CarriedOver => "carried_over",
            Basis::Given => "given",
        }
    }
}

/// Its fields are the `gpu` object of `fit --json` and `diagnose --json`; the ones skipped
/// there appear in every report's `assumptions`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Gpu {
    pub name: &'static str,
    /// Bytes `cudaMemGetInfo` reports as total.
    pub total_bytes: u64,
    /// CUDA context and friends for one process (torch 2.11, CUDA 13).
    pub cuda_context_bytes: u64,
    /// Where the total comes from.
    pub source: &'static str,
    /// What sets its cuBLAS workspaces and attention kernels.
    #[serde(skip)]
    pub arch: GpuArch,
    /// How the total is known: `Measured`, `OomMessage` or `Given`.
    #[serde(skip)]
    pub total_basis: Basis,
    /// `Measured` on the H100 and H200; `CarriedOver` from the H200 elsewhere.
    #[serde(skip)]
    pub context_basis: Basis,
}

/// One constant of a GPU, how it is known and where it comes from.
#[derive(Clone, Debug, PartialEq)]
pub struct Constant {
    pub bytes: u64,
    pub basis: Basis,
    pub source: String,
}

/// The CUDA context as measured on the H200 (`total - free` after `torch.zeros(1)`, the
/// first 2 MiB segment included), torch 2.11.0+cu130, CUDA 13, driver 580.159.04
/// (bench/calibration/h200-torch2.11.jsonl); the H100 reads the same
/// (bench/calibration/h100-torch2.11.jsonl). The context depends on the driver and CUDA more
/// than on the GPU, so it stands in for the others.
const CONTEXT: u64 = 650_969_088;

/// The built-in catalog. Measured entries say so; the others come from the totals PyTorch
/// prints in out-of-memory messages on those GPUs (two decimals of GiB, so ±5 MiB; each cites
/// the report it comes from), with the context measured on the H200.
pub fn catalog() -> Vec<Gpu> {
    let measured = |name, total_bytes, source| Gpu {
        name,
        total_bytes,
        cuda_context_bytes: CONTEXT,
        source,
        arch: GpuArch::Hopper,
        total_basis: Basis::Measured,
        context_basis: Basis::Measured,
    };
    let reported = |name, gib, arch, source| Gpu {
        name,
        total_bytes: from_gib(gib),
        cuda_context_bytes: CONTEXT,
        source,
        arch,
        total_basis: Basis::OomMessage,
        context_basis: Basis::CarriedOver,
    };
    vec![
        measured(
            "h200",
            150_109_880_320,
            "measured on an NVIDIA H200 (torch 2.11.0+cu130)",
        ),
        // Measured (bench/calibration/h100-torch2.11.jsonl, driver 580.159): 79.18 GiB, and
        // the same context as the H200. OOM messages elsewhere also show 79.11 GiB
        // (vllm-project/vllm#27508), a 70 MiB difference of driver or board.
        measured(
            "h100-80gb",
            85_017_493_504,
            "measured on an NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130)",
        ),
        // wbfwonderful/Vad-R1#11 (4 × A100 80GB): "total capacity of 79.25 GiB".
        reported(
            "a100-80gb",
            79.25,
            GpuArch::Ampere,
            "79.25 GiB in an OOM message on an A100 80GB (wbfwonderful/Vad-R1#11)",
        ),
        // philschmid/llm-sagemaker-sample#25 (ml.p4d.24xlarge, A100 40GB SXM): 39.39 GiB.
        reported(
            "a100-40gb",
            39.39,
            GpuArch::Ampere,
            "39.39 GiB in an OOM message on an A100 40GB (philschmid/llm-sagemaker-sample#25)",
        ),
        // stepfun-ai/Step-Video-T2V#8 (8 × L40S): "total capacity of 44.42 GiB".
        reported(
            "l40s",
            44.42,
            GpuArch::Ada,
            "44.42 GiB in an OOM message on an L40S (stepfun-ai/Step-Video-T2V#8)",
        ),
        // mistralai/mistral-finetune#69 (one A10G 24GB): "total capacity of 21.99 GiB".
        reported(
            "a10g",
            21.99,
            GpuArch::Ampere,
            "21.99 GiB in an OOM message on an A10G (mistralai/mistral-finetune#69)",
        ),
        // ali-vilab/VGen#104 (RTX 4090 24GB): "total capacity of 23.64 GiB".
        reported(
            "rtx-4090",
            23.64,
            GpuArch::Ada,
            "23.64 GiB in an OOM message on an RTX 4090 (ali-vilab/VGen#104)",
        ),
        // ucwxb/GraphAvatar#4 (RTX 3090 24GB): "23.69 GiB total capacity".
        reported(
            "rtx-3090",
            23.69,
            GpuArch::Ampere,
            "23.69 GiB in an OOM message on an RTX 3090 (ucwxb/GraphAvatar#4)",
        ),
        // haotian-liu/LLaVA#812 (8 × V100 32GB): "31.74 GiB total capacity".
        reported(
            "v100-32gb",
            31.74,
            GpuArch::Volta,
            "31.74 GiB in an OOM message on a V100 32GB (haotian-liu/LLaVA#812)",
        ),
        // meta-llama/llama#918 (8 × Tesla V100 16GB): "total capacty of 15.77 GiB".
        reported(
            "v100-16gb",
            15.77,
            GpuArch::Volta,
            "15.77 GiB in an OOM message on a V100 16GB (meta-llama/llama#918)",
        ),
        // ROCm/rocm-blogs, blogs/artificial-intelligence/gptq/README.md (MI300X):
        // "HIP out of memory. … total capacity of 191.98 GiB" (no issue-tracker report
        // found; KernelBench logs on MI300X VMs print 191.69 GiB).
        reported(
            "mi300x",
            191.98,
            GpuArch::Cdna3,
            "191.98 GiB in the OOM message of an AMD ROCm blog on MI300X; HIP context \
             not measured (the H200's CUDA context is used)",
        ),
    ]
}

/// Find a GPU by name (case-insensitive, `-`/`_`/space-insensitive), or a custom size such
/// as `64GiB` / `64GB`.
pub fn find(name: &str) -> Result<Gpu> {
    let key: String = name
        .to_ascii_lowercase()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .collect();
    let all = catalog();
    if let Some(gpu) = all.iter().find(|g| g.name.replace('-', "") == key) {
        return Ok(gpu.clone());
    }
    // A name as people say it (`h100`, `rtx4090`): the one entry it begins.
    let mut begun = all
        .iter()
        .filter(|g| !key.is_empty() && g.name.replace('-', "").starts_with(&key));
    if let (Some(gpu), None) = (begun.next(), begun.next()) {
        return Ok(gpu.clone());
    }
    if let Some(bytes) = parse_size(name) {
        return Ok(Gpu {
            name: "custom",
            total_bytes: bytes,
            source: "custom capacity; CUDA context as measured on the H200",
            total_basis: Basis::Given,
            context_basis: Basis::CarriedOver,
            ..Gpu::default()
        });
    }
    let names: Vec<&str> = all.iter().map(|g| g.name).collect();
    Err(Error::field(
        "gpu",
        format!("{name:?}"),
        format!("use one of {} or a size such as 64GiB", names.join(", ")),
    ))
}

/// The catalog entry for a device name as `torch.cuda.get_device_properties().name` reports it.
pub fn from_device_name(device: &str) -> Result<Gpu> {
    let d = device.to_ascii_lowercase();
    let name = if d.contains("h200") {
        "h200"
    } else if d.contains("h100") {
        "h100-80gb"
    } else if d.contains("a100") && d.contains("40") {
        "a100-40gb"
    } else if d.contains("a100") {
        "a100-80gb"
    } else if d.contains("l40s") {
        "l40s"
    } else if d.contains("a10g") {
        "a10g"
    } else if d.contains("4090") {
        "rtx-4090"
    } else if d.contains("3090") {
        "rtx-3090"
    } else if d.contains("v100") && d.contains("32") {
        "v100-32gb"
    } else if d.contains("v100") {
        "v100-16gb"
    } else if d.contains("mi300x") {
        "mi300x"
    } else {
        let known: Vec<&str> = catalog().iter().map(|g| g.name).collect();
        return Err(Error::field(
            "env.gpu",
            format!("{device:?}"),
            format!("headroom's GPU catalog has {}", known.join(", ")),
        ));
    };
    find(name)
}

impl Gpu {
    /// A capacity with no catalog entry behind it (`--gpu 64GiB`, or an OOM message's total far
    /// from every entry): its architecture is unknown and taken as Hopper.
    pub fn is_custom(&self) -> bool {
        self.name == "custom"
    }

    /// The library workspaces PyTorch allocates on this GPU.
    pub fn workspaces(&self) -> Workspaces {
        self.arch.workspaces()
    }

    /// Every constant the estimate takes from this GPU, with how it is known: the total, the
    /// CUDA context, the cuBLAS and the cuBLASLt workspaces.
    pub fn constants(&self) -> [Constant; 4] {
        let context_source = match self.context_basis {
            Basis::Measured => {
                "measured on the H100 and H200 alike (torch 2.11.0+cu130, CUDA 13, \
                 driver 580.159; bench/calibration)"
            }
            _ => {
                "carried over from the H200 (torch 2.11.0+cu130, CUDA 13, driver 580.159); \
                 not measured on this GPU"
            }
        };
        let ws = self.workspaces();
        let (basis, ws_source) = if self.is_custom() {
            (
                Basis::CarriedOver,
                format!("as on Hopper: {}", self.arch.workspace_source()),
            )
        } else if self.arch == GpuArch::Hopper {
            (Basis::Measured, self.arch.workspace_source().to_string())
        } else {
            (
                Basis::PytorchSource,
                self.arch.workspace_source().to_string(),
            )
        };
        [
            Constant {
                bytes: self.total_bytes,
                basis: self.total_basis,
                source: self.source.to_string(),
            },
            Constant {
                bytes: self.cuda_context_bytes,
                basis: self.context_basis,
                source: context_source.to_string(),
            },
            Constant {
                bytes: ws.cublas_bytes,
                basis,
                source: ws_source.clone(),
            },
            Constant {
                bytes: ws.cublaslt_bytes,
                basis,
                source: ws_source,
            },
        ]
    }

    /// A share of the device's total, as vLLM's `gpu_memory_utilization` budgets it (from
    /// `cudaMemGetInfo`'s total).
    pub fn share_bytes(&self, fraction: f64) -> u64 {
        (fraction * self.total_bytes as f64) as u64
    }

    /// Bytes the caching allocator can obtain: the device's total less what the process holds
    /// outside it. The context reading includes the first 2 MiB small segment, which the
    /// allocator itself reserves (and the simulation allocates), so that segment stays in.
    pub fn allocator_capacity(&self) -> u64 {
        const FIRST_SEGMENT: u64 = 2 << 20;
        self.total_bytes
            .saturating_sub(self.cuda_context_bytes.saturating_sub(FIRST_SEGMENT))
    }
}

impl Default for Gpu {
    fn default() -> Self {
        catalog().remove(0)
    }
}

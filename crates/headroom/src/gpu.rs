//! GPUs: the capacity PyTorch sees (`torch.cuda.mem_get_info()` total) and the memory a
//! process holds outside the caching allocator (CUDA context, kernels, the first small
//! segment), as `total - free` right after `torch.zeros(1, device="cuda")`.

use serde::Serialize;

use crate::error::{Error, Result};
use crate::units::{from_gib, parse_size};

/// Its fields are the `gpu` object of `fit --json` and `diagnose --json`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Gpu {
    pub name: &'static str,
    /// Bytes `cudaMemGetInfo` reports as total.
    pub total_bytes: u64,
    /// CUDA context and friends for one process (torch 2.11, CUDA 13).
    pub cuda_context_bytes: u64,
    /// Where the numbers come from.
    pub source: &'static str,
}

/// The built-in catalog. Measured entries say so; the others come from the totals PyTorch
/// prints in out-of-memory messages on those GPUs, with the context measured on the H200
/// (the context depends on the driver and CUDA more than on the GPU).
pub fn catalog() -> Vec<Gpu> {
    let context = 650_969_088;
    vec![
        Gpu {
            name: "h200",
            total_bytes: 150_109_880_320,
            cuda_context_bytes: context,
            source: "measured on an NVIDIA H200 (torch 2.11.0+cu130)",
        },
        // Totals below are `cudaMemGetInfo` totals as PyTorch prints them in OOM messages
        // (two decimals of GiB, so ±5 MiB); each cites the report it comes from.
        Gpu {
            name: "h100-80gb",
            // Measured (bench/calibration/h100-torch2.11.jsonl, driver 580.159): 79.18 GiB, and
            // the same context as the H200. OOM messages elsewhere also show 79.11 GiB
            // (vllm-project/vllm#27508), a 70 MiB difference of driver or board.
            total_bytes: 85_017_493_504,
            cuda_context_bytes: context,
            source: "measured on an NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130)",
        },
        Gpu {
            name: "a100-80gb",
            // wbfwonderful/Vad-R1#11 (4 × A100 80GB): "total capacity of 79.25 GiB".
            total_bytes: from_gib(79.25),
            cuda_context_bytes: context,
            source: "79.25 GiB in an OOM message on an A100 80GB (wbfwonderful/Vad-R1#11)",
        },
        Gpu {
            name: "a100-40gb",
            // philschmid/llm-sagemaker-sample#25 (ml.p4d.24xlarge, A100 40GB SXM): 39.39 GiB.
            total_bytes: from_gib(39.39),
            cuda_context_bytes: context,
            source: "39.39 GiB in an OOM message on an A100 40GB \
                     (philschmid/llm-sagemaker-sample#25)",
        },
        Gpu {
            name: "l40s",
            // stepfun-ai/Step-Video-T2V#8 (8 × L40S): "total capacity of 44.42 GiB".
            total_bytes: from_gib(44.42),
            cuda_context_bytes: context,
            source: "44.42 GiB in an OOM message on an L40S (stepfun-ai/Step-Video-T2V#8)",
        },
        Gpu {
            name: "a10g",
            // mistralai/mistral-finetune#69 (one A10G 24GB): "total capacity of 21.99 GiB".
            total_bytes: from_gib(21.99),
            cuda_context_bytes: context,
            source: "21.99 GiB in an OOM message on an A10G (mistralai/mistral-finetune#69)",
        },
        Gpu {
            name: "rtx-4090",
            // ali-vilab/VGen#104 (RTX 4090 24GB): "total capacity of 23.64 GiB".
            total_bytes: from_gib(23.64),
            cuda_context_bytes: context,
            source: "23.64 GiB in an OOM message on an RTX 4090 (ali-vilab/VGen#104)",
        },
        Gpu {
            name: "rtx-3090",
            // ucwxb/GraphAvatar#4 (RTX 3090 24GB): "23.69 GiB total capacity".
            total_bytes: from_gib(23.69),
            cuda_context_bytes: context,
            source: "23.69 GiB in an OOM message on an RTX 3090 (ucwxb/GraphAvatar#4)",
        },
        Gpu {
            name: "v100-32gb",
            // haotian-liu/LLaVA#812 (8 × V100 32GB): "31.74 GiB total capacity".
            total_bytes: from_gib(31.74),
            cuda_context_bytes: context,
            source: "31.74 GiB in an OOM message on a V100 32GB (haotian-liu/LLaVA#812)",
        },
        Gpu {
            name: "v100-16gb",
            // meta-llama/llama#918 (8 × Tesla V100 16GB): "total capacty of 15.77 GiB".
            total_bytes: from_gib(15.77),
            cuda_context_bytes: context,
            source: "15.77 GiB in an OOM message on a V100 16GB (meta-llama/llama#918)",
        },
        Gpu {
            name: "mi300x",
            // ROCm/rocm-blogs, blogs/artificial-intelligence/gptq/README.md (MI300X):
            // "HIP out of memory. … total capacity of 191.98 GiB" (no issue-tracker report
            // found; KernelBench logs on MI300X VMs print 191.69 GiB).
            total_bytes: from_gib(191.98),
            cuda_context_bytes: context,
            source: "191.98 GiB in the OOM message of an AMD ROCm blog on MI300X; HIP context \
                     not measured (the H200's CUDA context is used)",
        },
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
    if let Some(bytes) = parse_size(name) {
        return Ok(Gpu {
            name: "custom",
            total_bytes: bytes,
            cuda_context_bytes: all[0].cuda_context_bytes,
            source: "custom capacity; CUDA context as measured on the H200",
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

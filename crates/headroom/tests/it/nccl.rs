//! NCCL's communicators under Megatron-core, against bench/nccl-comms: the groups each rank
//! joins and uses (counted in the harness's runs), and the device memory outside the allocator
//! that real ranks read after their steps (`device_used_end_bytes` less reserved, less the CUDA
//! context) with every group's communicator made at once or only the used ones.

use headroom::estimate::{MegatronGroup, estimate_rank, megatron_groups};
use headroom::spec::RunSpec;
use serde_json::Value;

use crate::common::{jsonl, rel};

const SPECS: &str = include_str!("../../../../bench/nccl-comms/specs.jsonl");
const ONE_RANK: &str = include_str!("../../../../bench/nccl-comms/rows-nccl-h200-torch2.11.jsonl");
const FOUR_RANKS: &str =
    include_str!("../../../../bench/nccl-megatron-x4/rows-nccl-h200x4-torch2.11.jsonl");

fn census_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/nccl-comms/census")
}

fn groups_of(spec: &Value, rank: u64) -> Vec<MegatronGroup> {
    let spec = RunSpec::from_value(spec).expect("spec");
    let (_, arch) = spec.architecture(None, "").expect("architecture");
    megatron_groups(&spec, &arch, rank)
}

/// Every group of every census (eight layouts over 4 ranks, a rank of each stage, and two runs
/// of one rank): the same names in the same order, the same sizes, and a collective over
/// exactly the groups headroom counts as used.
#[test]
fn the_groups_are_those_each_rank_joined_and_used() {
    let mut checked = 0;
    for line in jsonl(&[SPECS]) {
        let id = line["id"].as_str().expect("id");
        let ranks: Vec<u64> = match line["fake_ranks"].as_array() {
            Some(r) => r.iter().map(|r| r.as_u64().expect("rank")).collect(),
            None => vec![0],
        };
        for rank in ranks {
            let file = census_dir().join(format!("{}-r{rank}.json", id.replace('/', "-")));
            let census: Value =
                serde_json::from_str(&std::fs::read_to_string(&file).expect("census")).expect(id);
            let joined: Vec<(String, u64, bool)> = census["groups"]
                .as_array()
                .expect("groups")
                .iter()
                .map(|g| {
                    let ops = g["ops"].as_object().expect("ops");
                    (
                        g["desc"].as_str().expect("desc").to_string(),
                        g["size"].as_u64().expect("size"),
                        !ops.is_empty(),
                    )
                })
                .collect();
            let modelled: Vec<(String, u64, bool)> = groups_of(&line["spec"], rank)
                .into_iter()
                .map(|g| (g.name.to_string(), g.size, g.used))
                .collect();
            assert_eq!(modelled, joined, "{id} rank {rank}");
            checked += 1;
        }
    }
    assert_eq!(checked, 16);
}

/// What a real rank held outside the allocator after its steps: device used, less its reserved
/// peak, less headroom's CUDA context.
fn measured_nccl(rank: &Value, context: u64) -> u64 {
    rank["device_used_end_bytes"].as_u64().expect("used")
        - rank["peak_reserved_bytes"].as_u64().expect("reserved")
        - context
}

/// A world of one rank holds 21 communicators of one rank when the default group is bound to
/// the device and the 4 a step uses when not; both read within 1.1%.
#[test]
fn one_rank_holds_a_communicator_per_group_made() {
    let gpu = headroom::gpu::find("h200").expect("h200");
    let mut seen = (0, 0);
    for row in jsonl(&[ONE_RANK]) {
        let id = row["id"].as_str().expect("id");
        let spec = RunSpec::from_value(&row["spec"]).expect(id);
        let est = estimate_rank(&spec, None, &gpu, 0).expect(id);
        let rank = &row["measured"]["ranks"][0];
        let err = rel(est.nccl_bytes, measured_nccl(rank, gpu.cuda_context_bytes));
        assert!(err.abs() < 0.011, "{id}: {err:+.4}");
        let eager = spec.megatron.expect("megatron").eager_nccl_init;
        let made = &est.nccl_communicators;
        assert_eq!(made.len(), if eager { 21 } else { 4 }, "{id}");
        assert!(
            made.iter()
                .all(|c| c.group.size == 1 && c.bytes == 388 << 20),
            "{id}"
        );
        // NCCL's kernels (170 MiB) and the run's own growth (152 MiB) besides.
        let communicators: u64 = made.iter().map(|c| c.bytes).sum();
        assert_eq!(est.nccl_bytes - communicators, 322 << 20, "{id}");
        if eager { seen.0 += 1 } else { seen.1 += 1 }
    }
    assert_eq!(seen, (2, 2));
}

/// Four H200s with every group made at once (the first call's five layouts, alone on the
/// device): the count of communicators is exact, their connections carried over from DDP's;
/// every rank within -2% to +10%, against the 1,612-2,584 MiB a table of whole layouts gave.
#[test]
fn four_ranks_with_every_group_made_read_within_ten_percent() {
    let gpu = headroom::gpu::find("h200").expect("h200");
    let mut checked = 0;
    for row in jsonl(&[FOUR_RANKS]) {
        let id = row["id"].as_str().expect("id");
        let spec = RunSpec::from_value(&row["spec"]).expect(id);
        for rank in row["measured"]["ranks"].as_array().expect("ranks") {
            // The second call's worlds shared the GPUs: their device readings are not their own.
            if rank["cuda_context_bytes"].as_u64().expect("context") > 1_100_000_000 {
                continue;
            }
            let r = rank["rank"].as_u64().expect("rank");
            let est = estimate_rank(&spec, None, &gpu, r).expect(id);
            let err = rel(est.nccl_bytes, measured_nccl(rank, gpu.cuda_context_bytes));
            assert!((-0.03..0.10).contains(&err), "{id} rank {r}: {err:+.4}");
            checked += 1;
        }
    }
    assert_eq!(checked, 20);
}

/// `fit` of a spec that binds the device says what Megatron-LM's lazy communicators would free
/// on the best layout's ranks (its eager and lazy counts' difference); a lazy spec hears nothing.
#[test]
fn fit_says_what_binding_the_device_costs() {
    use headroom::plan::Setup;
    use headroom::plan::layout;
    let yaml = |eager: bool| {
        format!(
            "model: llama-3.1-8b
model_config: {{model_type: llama, hidden_size: 4096, intermediate_size: 14336,
  num_attention_heads: 32, num_key_value_heads: 8, head_dim: 128, vocab_size: 128256,
  rope_theta: 500000.0, tie_word_embeddings: false, num_hidden_layers: 4}}
precision: bf16
optimizer: adamw
batch_size: 4
seq_len: 1024
parallel: {{strategy: ddp, world_size: 4, tp: 1, framework: megatron}}
megatron: {{distributed_optimizer: true, eager_nccl_init: {eager}}}
"
        )
    };
    let said = |eager: bool| {
        let spec =
            RunSpec::from_str_at(&yaml(eager), std::path::Path::new("t.yaml")).expect("spec");
        let setup = Setup {
            spec,
            spec_dir: None,
            gpu: headroom::gpu::find("h100-80gb").expect("gpu"),
            gpus: 4,
            residents: Vec::new(),
            launcher: Default::default(),
        };
        let search = layout::search(&setup).expect("search");
        let best = search
            .best()
            .expect("a layout fits")
            .candidate
            .spec(&setup.spec);
        let reasons = layout::reasons(&setup, &search);
        (best, reasons)
    };
    let (best, reasons) = said(true);
    let line = reasons
        .iter()
        .find(|r| r.contains("eager_nccl_init"))
        .unwrap_or_else(|| panic!("{reasons:?}"));
    let (_, arch) = best.architecture(None, "").expect("architecture");
    let mut lazy = best.clone();
    lazy.megatron.as_mut().expect("megatron").eager_nccl_init = false;
    let saved = headroom::estimate::run_nccl_bytes(&best, &arch, None)
        - headroom::estimate::run_nccl_bytes(&lazy, &arch, None);
    assert!(saved > 4 << 30, "{saved}");
    assert!(line.contains(&headroom::units::gib(saved)), "{line}");
    assert!(line.contains("all 21 process groups"), "{line}");
    let (_, reasons) = said(false);
    assert!(
        !reasons.iter().any(|r| r.contains("eager_nccl_init")),
        "{reasons:?}"
    );
}

//! `fit`'s layout search at scale: Llama-3.1-70B, a full bf16 fine-tune with AdamW, a global
//! batch of 1024 sequences of 4096 tokens, searched over 8 to 1024 GPUs on the H100 and the
//! H200 in one process (one `RankMemo`, as a sweep shares it). Prints each search's
//! candidates, distinct simulations and seconds, then the totals.
//! `cargo bench -p headroom --bench layouts`; results in bench/PERFORMANCE.md.

use std::time::Instant;

use headroom::gpu;
use headroom::plan::Setup;
use headroom::plan::layout::{self, RankMemo};
use headroom::spec::RunSpec;
use serde_json::json;

const GLOBAL_BATCH: u64 = 1024;

fn main() {
    let memo = RankMemo::default();
    let (mut candidates, mut simulated) = (0, 0);
    let start = Instant::now();
    println!("gpu        gpus  candidates  simulated  fitting  seconds  best");
    for gpu in ["h100-80gb", "h200"] {
        for gpus in [8u32, 16, 32, 64, 128, 256, 512, 1024] {
            let spec = RunSpec::from_value(&json!({
                "model": "llama-3.1-70b", "precision": "bf16", "optimizer": "adamw",
                "batch_size": GLOBAL_BATCH / u64::from(gpus), "seq_len": 4096,
            }))
            .expect("valid bench spec");
            let setup = Setup {
                spec,
                spec_dir: None,
                gpu: gpu::find(gpu).expect("catalog GPU"),
                gpus,
                residents: Vec::new(),
                launcher: Default::default(),
            };
            let t = Instant::now();
            let s = layout::search_with(&setup, &memo).expect("searches");
            println!(
                "{gpu:<10} {gpus:>5} {:>11} {:>10} {:>8} {:>8.2}  {}",
                s.candidates,
                s.simulated,
                s.ranked.len(),
                t.elapsed().as_secs_f64(),
                s.best().map_or("none fits".into(), |b| b.candidate.name())
            );
            candidates += s.candidates;
            simulated += s.simulated;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "total: {candidates} candidates, {simulated} simulated, {secs:.2} s ({:.0} candidates/s) on {} threads",
        candidates as f64 / secs,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
}

//! `fit`'s layout search at scale: Llama-3.1-70B at 4096 tokens a sequence, then
//! Qwen3-235B-A22B (MoE) at 4096, 8192 and 16384 (its sweep: more than 5,000 candidates), each
//! a full bf16 fine-tune with AdamW and a global batch of 1024 sequences, searched over 8 to 1024
//! GPUs on the H100, the H200 and the A100 80GB in one process (one `RankMemo`, as a sweep
//! shares it). Prints each search's candidates, distinct simulations, refusals (a pipeline over
//! the search's budget, or what the spec refuses) and seconds, then each model's totals with
//! the CPU time the process spent on them, and the part of it the main thread spent alone
//! (making and ranking candidates) while no simulation ran: the machine may be shared, and on
//! idle cores a search takes about that serial part plus the rest over the cores.
//! `cargo bench -p headroom --bench layouts`; results in bench/PERFORMANCE.md.
//!
//! Arguments (after `--`) that name a model, a GPU, a number of GPUs or a sequence length keep
//! only those; `LAYOUTS_ANSWERS=FILE`
//! writes every search's whole answer (`LayoutSearch`'s debug form: counts, refusals, every
//! fitting candidate with its numbers and cost, in rank order, and the closest when none
//! fits), one line each, so two builds' answers can be compared with `diff`.

use std::io::Write;
use std::time::Instant;

use headroom::gpu;
use headroom::plan::Setup;
use headroom::plan::layout::{self, RankMemo};
use headroom::spec::RunSpec;
use serde_json::json;

const GLOBAL_BATCH: u64 = 1024;

fn main() {
    let memo = RankMemo::default();
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let kept = |name: &str, all: &[&str]| {
        filters.iter().all(|f| !all.contains(&f.as_str())) || filters.iter().any(|f| f == name)
    };
    let mut answers = std::env::var_os("LAYOUTS_ANSWERS")
        .map(|path| std::fs::File::create(path).expect("LAYOUTS_ANSWERS is writable"));
    const MODELS: [&str; 2] = ["llama-3.1-70b", "qwen3-235b-a22b"];
    // The MoE also at the longer sequences of RL and long-context runs.
    let seq_lens = |model: &str| -> &[u64] {
        match model {
            "qwen3-235b-a22b" => &[4096, 8192, 16384],
            _ => &[4096],
        }
    };
    const SEQ_LENS: [&str; 3] = ["4096", "8192", "16384"];
    const GPUS: [&str; 3] = ["h100-80gb", "h200", "a100-80gb"];
    const WORLDS: [u32; 8] = [8, 16, 32, 64, 128, 256, 512, 1024];
    let worlds: Vec<String> = WORLDS.iter().map(u32::to_string).collect();
    let worlds: Vec<&str> = worlds.iter().map(String::as_str).collect();
    println!(
        "model            seq    gpu        gpus  candidates  simulated  refused  fitting  seconds  best"
    );
    for model in MODELS.into_iter().filter(|m| kept(m, &MODELS)) {
        let (mut candidates, mut simulated, mut refused) = (0, 0, 0);
        let (start, cpu_start, serial_start) =
            (Instant::now(), cpu_seconds(), main_thread_seconds());
        let searches = seq_lens(model)
            .iter()
            .filter(|s| kept(&s.to_string(), &SEQ_LENS))
            .flat_map(|&seq| GPUS.iter().map(move |&gpu| (seq, gpu)))
            .filter(|(_, g)| kept(g, &GPUS))
            .flat_map(|(seq, gpu)| WORLDS.iter().map(move |&w| (seq, gpu, w)))
            .filter(|(_, _, w)| kept(&w.to_string(), &worlds));
        for (seq_len, gpu, gpus) in searches {
            let spec = RunSpec::from_value(&json!({
                "model": model, "precision": "bf16", "optimizer": "adamw",
                "batch_size": GLOBAL_BATCH / u64::from(gpus), "seq_len": seq_len,
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
                "{model:<16} {seq_len:<6} {gpu:<10} {gpus:>5} {:>11} {:>10} {:>8} {:>8} {:>8.2}  {}",
                s.candidates,
                s.simulated,
                s.refused,
                s.ranked.len(),
                t.elapsed().as_secs_f64(),
                s.best().map_or("none fits".into(), |b| b.candidate.name())
            );
            if let Some(file) = answers.as_mut() {
                writeln!(file, "{model} {seq_len} {gpu} {gpus}: {s:?}").expect("answers written");
            }
            candidates += s.candidates;
            simulated += s.simulated;
            refused += s.refused;
        }
        let secs = start.elapsed().as_secs_f64();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cpu = cpu_seconds() - cpu_start;
        let serial = main_thread_seconds() - serial_start;
        println!(
            "total {model}: {candidates} candidates ({refused} refused), {simulated} simulated, \
             {secs:.2} s wall ({:.0} candidates/s), {cpu:.2} s CPU on {threads} threads \
             ({:.2} ms a candidate), {serial:.2} s of it on the main thread alone: on {threads} \
             idle cores about {:.2} s ({:.2} s per 5,000 candidates)",
            candidates as f64 / secs,
            1e3 * cpu / candidates as f64,
            idle_seconds(cpu, serial, threads),
            idle_seconds(cpu, serial, threads) * 5000.0 / candidates as f64,
        );
    }
}

/// Wall time on `threads` idle cores: the serial part, then the rest spread over the cores
/// (the search's jobs start most costly first, so the cores run out of work within about one
/// short simulation of each other).
fn idle_seconds(cpu: f64, serial: f64, threads: usize) -> f64 {
    serial + (cpu - serial) / threads as f64
}

/// CPU time of the main thread so far (`/proc/thread-self/schedstat`, nanoseconds): what the
/// search does outside its simulation threads.
fn main_thread_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    let ns = stat
        .split_whitespace()
        .next()
        .and_then(|f| f.parse::<f64>().ok());
    ns.unwrap_or(0.0) / 1e9
}

/// User and system CPU time of this process so far (`/proc/self/stat`, clock ticks of 1/100 s).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after_name = stat.rsplit(')').next().unwrap_or_default();
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // Fields 14 and 15 of proc(5), counted from the state (field 3) here.
    (ticks(11) + ticks(12)) / 100.0
}

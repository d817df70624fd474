//! No input crashes the library or runs away with it: each input a fuzz of the binary found
//! crashing it or running for tens of seconds is refused by name (or estimated), at once.

use std::path::Path;
use std::time::{Duration, Instant};

use headroom::estimate::{self, Estimate, Limit, PipelineEstimate};
use headroom::gpu::{self, Gpu};
use headroom::spec::{self, Document, PipelineSpec, RunSpec};

fn h100() -> Gpu {
    gpu::find("h100-80gb").expect("a catalog GPU")
}

fn document(yaml: &str) -> headroom::Result<Document> {
    let doc = spec::parse_document(yaml, Path::new("spec.yaml"))?;
    if spec::is_pipeline(&doc) {
        PipelineSpec::from_value(&doc).map(Document::Pipeline)
    } else {
        RunSpec::from_value(&doc).map(|s| Document::Run(Box::new(s)))
    }
}

fn estimate_run(yaml: &str) -> headroom::Result<Estimate> {
    match document(yaml)? {
        Document::Run(spec) => estimate::estimate(&spec, None, &h100()),
        Document::Pipeline(_) => panic!("a run spec"),
    }
}

fn estimate_pipeline(yaml: &str) -> headroom::Result<PipelineEstimate> {
    match document(yaml)? {
        Document::Pipeline(spec) => estimate::estimate_pipeline(&spec, None, &h100(), Limit::Gpu),
        Document::Run(_) => panic!("a pipeline"),
    }
}

/// The message of the error `yaml` must be refused with, as a run spec or a pipeline.
fn refusal(yaml: &str) -> String {
    let start = Instant::now();
    let err = match document(yaml) {
        Err(e) => e,
        Ok(Document::Run(spec)) => estimate::estimate(&spec, None, &h100()).expect_err("refused"),
        Ok(Document::Pipeline(spec)) => {
            estimate::estimate_pipeline(&spec, None, &h100(), Limit::Gpu).expect_err("refused")
        }
    };
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "refused after {:?}",
        start.elapsed()
    );
    err.to_string()
}

fn tiny(config_fields: &str) -> String {
    format!(
        "model: custom\nbatch_size: 1\nseq_len: 64\nmodel_config: {{model_type: llama, \
         hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, \
         num_attention_heads: 4, vocab_size: 100, {config_fields}}}\n"
    )
}

#[test]
fn zero_key_value_heads_are_refused_by_their_path_not_divided_by() {
    let message = refusal(&tiny("num_key_value_heads: 0"));
    assert!(
        message.starts_with("`model_config.num_key_value_heads`: 0 is not allowed"),
        "{message}"
    );
    let message = refusal(&tiny("num_key_value_heads: 3"));
    assert!(
        message.contains("it must divide num_attention_heads (4)"),
        "{message}"
    );
}

#[test]
fn a_gpt2_inner_width_of_zero_is_refused() {
    let message = refusal(
        "model: custom\nmodel_config: {model_type: gpt2, n_embd: 64, n_inner: 0, n_layer: 2, \
         n_head: 4, vocab_size: 100}\n",
    );
    assert!(
        message.starts_with("`model_config.n_inner`: 0"),
        "{message}"
    );
}

#[test]
fn sizes_that_would_overflow_or_allocate_a_terabyte_are_refused_with_the_limit() {
    let message =
        refusal(&tiny("vocab_size: 18446744073709551615").replace("vocab_size: 100, ", ""));
    assert!(
        message.starts_with("`model_config.vocab_size`"),
        "{message}"
    );
    assert!(message.contains("from 1 to 16777216"), "{message}");
    for layers in ["30000", "1099511627776"] {
        let yaml =
            tiny(&format!("num_hidden_layers: {layers}")).replace("num_hidden_layers: 2, ", "");
        let message = refusal(&yaml);
        assert!(
            message.starts_with(&format!("`model_config.num_hidden_layers`: {layers}")),
            "{message}"
        );
        assert!(message.contains("from 1 to 1000"), "{message}");
    }
    let message = refusal("model: qwen2.5-0.5b\nbatch_size: 18446744073709551615\n");
    assert!(message.starts_with("`batch_size`"), "{message}");
}

#[test]
fn a_batch_past_the_gpu_is_estimated_with_expandable_segments() {
    // The unlimited run's expandable segment was reserved for a 1 TiB device and refused the
    // 1.2 TB logits: "an allocator without a capacity limit does not run out" panicked.
    let est = estimate_run(
        "model: qwen2.5-0.5b\nbatch_size: 1000\nseq_len: 2048\n\
         allocator: {expandable_segments: true}\n",
    )
    .expect("an estimate");
    assert!(!est.fits());
    assert!(
        est.peak_allocated_bytes > 1 << 40,
        "{}",
        est.peak_allocated_bytes
    );
}

#[test]
fn a_tensor_no_device_holds_is_refused_naming_the_batch() {
    let message = refusal(
        "model: custom\nmode: forward\nattention: eager\nbatch_size: 1\nseq_len: 16777216\n\
         model_config: {model_type: llama, hidden_size: 1024, intermediate_size: 1024, \
         num_hidden_layers: 1, num_attention_heads: 1024, vocab_size: 100}\n",
    );
    assert!(
        message.starts_with("`batch_size`: 1 is not allowed"),
        "{message}"
    );
    assert!(message.contains("1 EiB"), "{message}");
}

#[test]
fn errors_inside_pipeline_instances_keep_their_path() {
    let pipeline = |instance: &str| {
        format!(
            "instances:\n  - {{name: a, {instance}}}\nphases:\n  - {{name: p, run: [a]}}\n\
             iterations: 1\n"
        )
    };
    let message = refusal(&pipeline("model: no-such-model"));
    assert!(message.starts_with("`instances[0].model`"), "{message}");
    let message = refusal(&pipeline(
        "model: custom, model_config: {model_type: llama, hidden_size: 64, \
         intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, \
         num_key_value_heads: 0, vocab_size: 100}",
    ));
    assert!(
        message.starts_with("`instances[0].model_config.num_key_value_heads`: 0"),
        "{message}"
    );
    let message = refusal(&pipeline(
        "model: qwen2.5-0.5b, lora: {targets: [no_proj]}, mode: forward",
    ));
    assert!(
        message.starts_with("`instances[0].lora.targets`"),
        "{message}"
    );
}

#[test]
fn nan_and_infinities_are_named_as_such() {
    for (text, name) in [
        (".nan", "NaN"),
        (".inf", "infinity"),
        ("-.inf", "-infinity"),
    ] {
        let message = refusal(&format!(
            "model: qwen2.5-0.5b\nlora: {{r: 8, alpha: {text}}}\n"
        ));
        assert!(
            message.starts_with(&format!("`lora.alpha`: {name} is not allowed")),
            "{message}"
        );
    }
    let message = refusal(
        "instances:\n  - {name: a, model: qwen2.5-0.5b, engine: vllm, \
         gpu_memory_utilization: .nan}\nphases: [{name: p, run: [a]}]\n",
    );
    assert!(
        message.starts_with("`instances[0].gpu_memory_utilization`: NaN"),
        "{message}"
    );
}

#[test]
fn a_key_given_twice_is_refused_by_name() {
    let message = refusal("model: qwen2.5-0.5b\nbatch_size: 1\nbatch_size: 64\n");
    assert!(message.contains("duplicate"), "{message}");
    assert!(message.contains("batch_size"), "{message}");
}

#[test]
fn a_huge_value_is_not_echoed_whole() {
    let value = "x".repeat(1 << 20);
    for yaml in [
        format!("model: qwen2.5-0.5b\nprecision: {value}\n"),
        format!("model: {value}\n"),
        format!("model: qwen2.5-0.5b\nlora: {{targets: [{value}]}}\n"),
    ] {
        let message = refusal(&yaml);
        assert!(message.len() < 2000, "{} bytes", message.len());
        assert!(message.contains(" characters)"), "{message}");
    }
    // YAML keys are at most 1024 characters: a longer one is a syntax error, named briefly.
    let message = refusal(&format!("model: qwen2.5-0.5b\n{value}: 1\n"));
    assert!(message.len() < 2000, "{} bytes", message.len());
}

#[test]
fn deep_nesting_is_refused_before_the_parser_spends_seconds_on_it() {
    let deep = format!("model: {}{}\n", "[".repeat(250_000), "]".repeat(250_000));
    let message = refusal(&deep);
    assert!(message.contains("nested more than 64 deep"), "{message}");
    let deep = format!(
        "model: {}1{}\n",
        "{a: ".repeat(100_000),
        "}".repeat(100_000)
    );
    assert!(refusal(&deep).contains("nested more than 64 deep"));
}

#[test]
fn a_spec_file_too_large_is_refused_before_it_is_read() {
    let path = std::env::temp_dir().join(format!("headroom-large-{}.yaml", std::process::id()));
    std::fs::write(
        &path,
        format!("model: qwen2.5-0.5b\n# {}\n", "x".repeat(2 << 20)),
    )
    .expect("a temporary file");
    let result = spec::load(&path);
    std::fs::remove_file(&path).expect("removed");
    let message = result.expect_err("refused").to_string();
    assert!(
        message.contains("a spec or model config has at most 1048576 bytes"),
        "{message}"
    );
}

#[test]
fn pipeline_work_is_bounded_by_name() {
    let generate = |new_tokens: u64| {
        format!(
            "instances:\n  - {{name: a, model: qwen2.5-0.5b, mode: forward, batch_size: 1, \
             seq_len: 1000000}}\nphases:\n  - {{name: g, run: [{{instance: a, pass: generate, \
             new_tokens: {new_tokens}}}]}}\niterations: 1\n"
        )
    };
    let message = refusal(&generate(999_999));
    assert!(
        message.starts_with("`phases[0].run[0].new_tokens`: 999999 is not allowed"),
        "{message}"
    );
    let message = refusal(
        "instances:\n  - {name: a, model: qwen2.5-0.5b, batch_size: 1, seq_len: 512}\n\
         phases:\n  - {name: t, run: [{instance: a, pass: train, repeat: 64}]}\n\
         iterations: 100\n",
    );
    assert!(
        message.starts_with("`iterations`: 100 is not allowed"),
        "{message}"
    );
    let instances: String = (0..17)
        .map(|i| format!("  - {{name: m{i}, model: qwen2.5-0.5b}}\n"))
        .collect();
    let message = refusal(&format!(
        "instances:\n{instances}phases:\n  - {{name: t, run: [m0]}}\n"
    ));
    assert!(
        message.starts_with("`instances`: a list of 17"),
        "{message}"
    );
}

#[test]
fn a_pipeline_within_its_budget_is_estimated() {
    let est = estimate_pipeline(
        "instances:\n  - {name: a, model: qwen2.5-0.5b, mode: forward, batch_size: 1, \
         seq_len: 600}\nphases:\n  - {name: g, run: [{instance: a, pass: generate, \
         new_tokens: 500}]}\niterations: 1\n",
    )
    .expect("an estimate");
    assert!(est.fits());
}

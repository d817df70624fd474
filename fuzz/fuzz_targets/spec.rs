//! Any bytes as a spec file's text: parsing ends in `Ok` or `Err`, as a run and as a pipeline.
#![no_main]

use std::path::Path;

use headroom::spec::{PipelineSpec, RunSpec, parse_document};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(doc) = parse_document(text, Path::new("fuzz.yaml")) {
        let _ = RunSpec::from_value(&doc);
        let _ = PipelineSpec::from_value(&doc);
    }
});

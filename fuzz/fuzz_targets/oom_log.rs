//! Any bytes as a pasted out-of-memory log, read as `headroom diagnose --oom` reads a file:
//! every message found parses and explains without panicking.
#![no_main]

use headroom::diagnose::{decode_log, oom_message};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for message in oom_message::parse_all(&decode_log(data)) {
        let _ = oom_message::explain(&message);
    }
});

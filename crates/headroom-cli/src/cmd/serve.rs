//! `headroom serve`: a local web page over the same library as the commands. A spec pasted
//! or edited there is estimated (its JSON is `estimate --json`'s, its timeline `estimate
//! --plot`'s), fitted, a snapshot dropped on it read, an OOM message pasted diagnosed. The
//! page is in the binary and loads nothing from elsewhere; the server listens on 127.0.0.1
//! unless told otherwise, reads bodies within the library's limits, and answers bad input
//! with 400 and the error the command would print, its field, value and what is allowed.

use std::convert::Infallible;
use std::net::IpAddr;
use std::path::Path;

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response};
use hyper_util::rt::TokioIo;

use headroom::diagnose::{self, Inputs, OomLog};
use headroom::gpu::{self, Gpu};
use headroom::limits::{MAX_FILE_BYTES, MAX_OOM_LOG_BYTES};
use headroom::plan::{self, Launcher, Setup};
use headroom::report::diagnose::DiagnoseJson;
use headroom::report::fit::FitJson;
use headroom::report::to_json;
use headroom::spec::{self, Document};
use headroom_snapshot::report::SnapshotJson;
use headroom_snapshot::{SummaryOptions, summarize};
use serde_json::{Value, json};

use crate::error::{CliError, CliResult};

#[derive(clap::Args)]
pub struct Args {
    /// The port to listen on (0: any free one; the address is printed).
    #[arg(long, default_value_t = 8765)]
    pub port: u16,
    /// The address to listen on; the default keeps the page to this machine.
    #[arg(long, default_value = "127.0.0.1")]
    pub bind: IpAddr,
}

/// The page, with its script and style: nothing is fetched from elsewhere.
const PAGE: &str = include_str!("serve.html");

/// The largest snapshot accepted over HTTP: a real step's trace is tens of MiB compressed.
pub const MAX_SNAPSHOT_UPLOAD_BYTES: u64 = 256 << 20;

/// An example spec: its file name and text.
macro_rules! example {
    ($name:literal) => {
        ($name, include_str!(concat!("../../../../examples/", $name)))
    };
}

/// Every spec in `examples/`, one click away on the page.
pub const EXAMPLES: &[(&str, &str)] = &[
    example!("qwen2.5-7b-lora.yaml"),
    example!("llama-2-7b-qlora.yaml"),
    example!("llama-3.1-8b-full.yaml"),
    example!("mistral-7b-reward-model.yaml"),
    example!("qwen3-8b-ref-logprob.yaml"),
    example!("qwen3-30b-a3b-lora.yaml"),
    example!("qwen3-30b-a3b-lora-attention.yaml"),
    example!("trl-dpo.yaml"),
    example!("trl-grpo.yaml"),
    example!("dpo-deepspeed-zero3.yaml"),
    example!("grpo-vllm-colocated.yaml"),
    example!("verl-actor-fsdp2.yaml"),
    example!("slime-grpo-fsdp2.yaml"),
    example!("qwen3-235b-a22b-megatron-grpo-slime.yaml"),
    example!("llama-3.1-70b-tp8-fsdp2-64xh100.yaml"),
    example!("llama-3.1-405b-tp8-fsdp2-512xh100.yaml"),
    example!("llama-3.1-70b-pp8-interleaved-8xh200.yaml"),
    example!("llama-3.1-70b-megatron-tp8-pp4-64xh100.yaml"),
    example!("llama-3.1-70b-megatron-tp8-pp4-vpp4-64xh100.yaml"),
    example!("llama-3.1-405b-megatron-tp8-pp16-512xh100.yaml"),
    example!("llama-3.1-70b-pp4-fsdp2-32xh200.yaml"),
    example!("llama-3.1-405b-tp8-cp8-fsdp2-512xh100-128k.yaml"),
    example!("seed000-reuse.yaml"),
    example!("seed000-reload.yaml"),
    example!("seed001-ref-resident.yaml"),
    example!("seed001-ref-manual-offload.yaml"),
    example!("seed001-ref-fsdp2-offload.yaml"),
    example!("seed002-grpo-agent-user.yaml"),
    example!("seed002-grpo-agent-trl.yaml"),
    example!("seed003-phi3-dpo.yaml"),
    example!("seed003-phi3-dpo-trl.yaml"),
    example!("seed004-rm-8x64gb.yaml"),
    example!("seed004-rm-zero2-8x64gb.yaml"),
    example!("seed004-rm-zero2-offload-8x64gb.yaml"),
    example!("seed004-rm-lora-8x64gb.yaml"),
    example!("seed004-rm-trl-8x64gb.yaml"),
    example!("seed004-safe-mm-dpo.yaml"),
];

/// Serves until killed. Connections are tasks on tokio's runtime, so a browser's idle
/// keep-alive connections hold no thread; each request's work (a `fit` takes seconds) runs on
/// the blocking pool, so an estimate need not wait for a fit.
pub fn run(args: Args) -> CliResult {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(|e| CliError::input(format!("cannot start the server: {e}")))?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((args.bind, args.port))
            .await
            .map_err(|e| CliError::input(format!("--port {}: cannot listen: {e}", args.port)))?;
        let address = listener
            .local_addr()
            .map_err(|e| CliError::input(format!("--port {}: {e}", args.port)))?;
        // Tests and scripts read the address from this line.
        println!("headroom serve: http://{address}/");
        loop {
            // A failed accept drops that connection only; out of file descriptors, it fails
            // at once until one is closed, so the loop waits a moment rather than spin.
            let Ok((stream, _)) = listener.accept().await else {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            };
            tokio::spawn(async move {
                // A client that went away is no error of ours.
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service_fn(respond))
                    .await;
            });
        }
    })
}

/// An answer: its status, content type and body.
struct Answer {
    status: u16,
    content_type: &'static str,
    body: Vec<u8>,
}

impl Answer {
    /// JSON as the command prints it, newline included.
    fn json(body: String) -> Self {
        Answer {
            status: 200,
            content_type: "application/json",
            body: (body + "\n").into_bytes(),
        }
    }

    fn svg(body: String) -> Self {
        Answer {
            status: 200,
            content_type: "image/svg+xml",
            body: body.into_bytes(),
        }
    }

    /// An error as JSON: `message` as the command prints it, and the field, value and what
    /// is allowed where the error names them.
    fn error(status: u16, message: String, parts: Value) -> Self {
        let mut error = json!({ "message": message });
        if let (Some(error), Value::Object(parts)) = (error.as_object_mut(), parts) {
            error.extend(parts);
        }
        Answer {
            status,
            content_type: "application/json",
            body: to_json(&json!({ "error": error })).into_bytes(),
        }
    }
}

impl From<headroom::Error> for Answer {
    fn from(err: headroom::Error) -> Self {
        use headroom::Error as E;
        let named = err.named();
        let mut parts =
            json!({ "field": named.field, "value": named.value, "allowed": named.allowed });
        match &err {
            E::UnknownModel { suggestions, .. } => parts["suggestions"] = json!(suggestions),
            E::Syntax { line, column, .. } => parts = json!({ "line": line, "column": column }),
            _ => {}
        }
        Answer::error(400, err.to_string(), parts)
    }
}

impl From<CliError> for Answer {
    fn from(err: CliError) -> Self {
        Answer::error(400, err.message, json!({}))
    }
}

type Answered = Result<Answer, Answer>;

async fn respond(request: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let (parts, body) = request.into_parts();
    let path = parts.uri.path().to_string();
    let query: Vec<(String, String)> = parts
        .uri
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect();
    let answer = match read_body(&parts, body, &path).await {
        Ok(body) => {
            let method = parts.method;
            tokio::task::spawn_blocking(move || route(&method, &path, &query, &body))
                .await
                // The library is total; a panic would be a bug, answered as one rather than
                // dropped.
                .unwrap_or_else(|_| {
                    Err(Answer::error(
                        500,
                        "internal error (a bug: please report the input)".into(),
                        json!({}),
                    ))
                })
                .unwrap_or_else(|e| e)
        }
        Err(answer) => answer,
    };
    // Every answer is whole in memory: sent with its length, never chunked.
    Ok(Response::builder()
        .status(answer.status)
        .header("Content-Type", answer.content_type)
        .body(Full::new(Bytes::from(answer.body)))
        .expect("a status and header of our own are valid"))
}

fn route(method: &Method, path: &str, query: &[(String, String)], body: &[u8]) -> Answered {
    let param = |key: &str| {
        query
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .filter(|v| !v.is_empty())
    };
    let picture = match param("format") {
        None | Some("json") => false,
        Some("svg") => true,
        Some(other) => {
            return Err(Answer::error(
                400,
                format!("`format`: {other:?} is not allowed; use json or svg"),
                json!({ "field": "format", "value": other, "allowed": "json, svg" }),
            ));
        }
    };
    match (method, path) {
        (&Method::GET, "/" | "/index.html") => Ok(Answer {
            status: 200,
            content_type: "text/html; charset=utf-8",
            body: PAGE.as_bytes().to_vec(),
        }),
        (&Method::GET, "/api/examples") => {
            let list: Vec<Value> = EXAMPLES
                .iter()
                .map(|(name, text)| json!({ "name": name, "text": text }))
                .collect();
            Ok(Answer::json(to_json(&list)))
        }
        (&Method::POST, "/api/estimate") => {
            let text = body_text(body, "spec")?;
            let document = spec::from_text(&text, Path::new("spec"))?;
            let (gpu, given) = find_gpu(param("gpu"))?;
            let title = picture.then(|| param("title").unwrap_or("spec").to_string());
            let answer = super::estimate::answer(&document, &gpu, given, title.as_deref())?;
            Ok(if picture {
                Answer::svg(answer)
            } else {
                Answer::json(answer)
            })
        }
        (&Method::POST, "/api/fit") => {
            let text = body_text(body, "spec")?;
            let spec = match spec::from_text(&text, Path::new("spec"))? {
                Document::Run(spec) => *spec,
                Document::Pipeline(_) => {
                    return Err(headroom::Error::field(
                        "spec",
                        "a pipeline",
                        "fit plans a run spec (one model); estimate takes pipelines",
                    )
                    .into());
                }
            };
            let (gpu, given) = find_gpu(param("gpu"))?;
            if !given {
                return Err(Answer::error(
                    400,
                    "`gpu`: missing; fit needs the GPU to fit (h100-80gb, h200, ... or a size like 64GiB)".into(),
                    json!({ "field": "gpu", "value": "", "allowed": "a GPU name or a size" }),
                ));
            }
            let gpus = spec.world_size();
            let setup = Setup {
                spec,
                spec_dir: None,
                gpu,
                gpus,
                residents: Vec::new(),
                launcher: Launcher::Script,
            };
            let report = plan::fit(&setup)?;
            Ok(if picture {
                let title = format!("{} on {}", param("title").unwrap_or("spec"), setup.gpu.name);
                Answer::svg(super::fit::front_svg(&title, &setup, &report))
            } else {
                Answer::json(to_json(&FitJson::new(&setup, &report)))
            })
        }
        (&Method::POST, "/api/diagnose") => {
            let text = body_text(body, "log")?;
            let inputs = Inputs {
                oom: Some(OomLog {
                    source: "the pasted message".into(),
                    text,
                }),
                gpu: param("gpu").map(str::to_string),
                ..Inputs::default()
            };
            let diagnosis = diagnose::run(&inputs)?;
            Ok(Answer::json(to_json(&DiagnoseJson::new(&diagnosis))))
        }
        (&Method::POST, "/api/snapshot") => {
            let name = param("name").unwrap_or("snapshot").to_string();
            let snapshot = headroom_snapshot::from_bytes(body)
                .map_err(|e| Answer::error(400, format!("{name}: {e}"), json!({})))?;
            let summary = summarize(&snapshot, SummaryOptions::default());
            if picture {
                let trace = summary.trace.as_ref().ok_or_else(|| {
                    Answer::error(
                        400,
                        format!("{name}: the snapshot has no trace to plot (record with _record_memory_history)"),
                        json!({}),
                    )
                })?;
                let title = format!("{name} (device {})", trace.device);
                return Ok(Answer::svg(super::snapshot::trace_svg(
                    &title,
                    &trace.timeline,
                )));
            }
            Ok(Answer::json(to_json(&SnapshotJson::new(name, &summary))))
        }
        (_, "/" | "/index.html" | "/api/examples") => Err(not_allowed("GET")),
        (_, "/api/estimate" | "/api/fit" | "/api/diagnose" | "/api/snapshot") => {
            Err(not_allowed("POST"))
        }
        _ => Err(Answer::error(
            404,
            format!(
                "{path}: no such page (the API: /api/estimate, /api/fit, /api/diagnose, /api/snapshot, /api/examples)"
            ),
            json!({}),
        )),
    }
}

fn not_allowed(method: &str) -> Answer {
    Answer::error(405, format!("use {method} here"), json!({}))
}

/// The GPU named by `?gpu=` (and whether one was), else the default.
fn find_gpu(name: Option<&str>) -> Result<(Gpu, bool), Answer> {
    Ok(match name {
        Some(name) => (gpu::find(name)?, true),
        None => (Gpu::default(), false),
    })
}

/// The most bytes a POST to `path` may carry, and what its body is (named in errors).
fn body_limit(path: &str) -> Option<(u64, &'static str)> {
    match path {
        "/api/estimate" | "/api/fit" => Some((MAX_FILE_BYTES, "spec")),
        "/api/diagnose" => Some((MAX_OOM_LOG_BYTES, "log")),
        "/api/snapshot" => Some((MAX_SNAPSHOT_UPLOAD_BYTES, "snapshot")),
        _ => None,
    }
}

/// A POST's body, read whole before the request is routed and refused past the path's limit;
/// empty for every other request.
async fn read_body(
    parts: &hyper::http::request::Parts,
    body: Incoming,
    path: &str,
) -> Result<Vec<u8>, Answer> {
    let Some((limit, what)) = body_limit(path).filter(|_| parts.method == Method::POST) else {
        return Ok(Vec::new());
    };
    let too_large = || {
        Answer::error(
            413,
            format!("the {what} is larger than {limit} bytes, the most accepted"),
            json!({ "field": what, "allowed": format!("at most {limit} bytes") }),
        )
    };
    let declared = parts
        .headers
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(too_large());
    }
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes().to_vec()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(too_large()),
        Err(e) => Err(Answer::error(
            400,
            format!("cannot read the {what}: {e}"),
            json!({}),
        )),
    }
}

/// The body as text: UTF-8, or any encoding a paste comes in for an OOM log.
fn body_text(bytes: &[u8], what: &str) -> Result<String, Answer> {
    if what == "log" {
        return Ok(diagnose::decode_log(bytes));
    }
    String::from_utf8(bytes.to_vec()).map_err(|e| {
        Answer::error(
            400,
            format!(
                "the {what} is not UTF-8 text (byte {})",
                e.utf8_error().valid_up_to()
            ),
            json!({ "field": what, "allowed": "YAML or JSON text in UTF-8" }),
        )
    })
}

/// A query component with `%XX` escapes and `+` decoded.
fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => match bytes
                .get(i + 1..i + 3)
                .filter(|h| h.iter().all(u8::is_ascii_hexdigit))
            {
                Some(hex) => {
                    let text = std::str::from_utf8(hex).expect("hex digits are ASCII");
                    out.push(u8::from_str_radix(text, 16).expect("two hex digits"));
                    i += 2;
                }
                None => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_components_decode_and_garbage_stays() {
        assert_eq!(decode("h100-80gb"), "h100-80gb");
        assert_eq!(decode("a%20b+c"), "a b c");
        assert_eq!(decode("100%"), "100%");
        assert_eq!(decode("%zz%4"), "%zz%4");
        assert_eq!(decode("%C3%A9"), "é");
    }

    #[test]
    fn every_example_is_on_the_page() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .expect("examples/")
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.ends_with(".yaml"))
            .collect();
        files.sort();
        let mut listed: Vec<String> = EXAMPLES.iter().map(|(n, _)| n.to_string()).collect();
        listed.sort();
        assert_eq!(files, listed);
    }
}

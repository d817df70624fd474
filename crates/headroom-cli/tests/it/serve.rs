//! `headroom serve`: the API answers as the commands do (the same JSON, the same errors with
//! their field, value and what is allowed), refuses what is too large or malformed with a
//! status and a message, and never goes down on garbage.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};

use serde_json::Value;

use super::common::{headroom, repo, stdout};

/// A `headroom serve` on a free port of 127.0.0.1, ended when dropped.
pub struct Served {
    child: Child,
    pub addr: String,
}

impl Served {
    pub fn start() -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_headroom"))
            .args(["serve", "--port", "0"])
            .current_dir(repo())
            .stdout(Stdio::piped())
            .spawn()
            .expect("the server starts");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("the address line");
        let addr = line
            .trim()
            .strip_prefix("headroom serve: http://")
            .and_then(|a| a.strip_suffix('/'))
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_string();
        assert!(addr.starts_with("127.0.0.1:"), "{addr}");
        Served { child, addr }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// One request: (status, content type, body).
    pub fn request(&self, method: &str, path: &str, body: &[u8]) -> (u16, String, Vec<u8>) {
        let mut stream = TcpStream::connect(&self.addr).expect("connects");
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            self.addr,
            body.len()
        );
        // A server that answers before reading a body it refuses may close early.
        let _ = stream
            .write_all(head.as_bytes())
            .and_then(|()| stream.write_all(body));
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
        let split = answer
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("a head and a body");
        let head = String::from_utf8_lossy(&answer[..split]).into_owned();
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("a status");
        let content_type = head
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-type: ")
                    .map(str::to_string)
            })
            .unwrap_or_default();
        (status, content_type, answer[split + 4..].to_vec())
    }

    pub fn post(&self, path: &str, body: &[u8]) -> (u16, Value) {
        let (status, _, body) = self.request("POST", path, body);
        let value = serde_json::from_slice(&body).unwrap_or_else(|e| {
            panic!("{path}: not JSON ({e}): {}", String::from_utf8_lossy(&body))
        });
        (status, value)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn read(path: &str) -> Vec<u8> {
    std::fs::read(repo().join(path)).expect(path)
}

#[test]
fn estimate_answers_the_json_of_estimate_json() {
    let server = Served::start();
    for (spec, gpu) in [
        ("examples/qwen2.5-7b-lora.yaml", Some("h100-80gb")),
        ("examples/seed003-phi3-dpo.yaml", Some("h100-80gb")),
        ("examples/llama-2-7b-qlora.yaml", None),
    ] {
        let mut args = vec!["estimate", spec, "--json"];
        let mut path = "/api/estimate".to_string();
        if let Some(gpu) = gpu {
            args.extend(["--gpu", gpu]);
            path += &format!("?gpu={gpu}");
        }
        let cli = stdout(&headroom(&args));
        let (status, content_type, body) = server.request("POST", &path, &read(spec));
        assert_eq!(status, 200, "{spec}");
        assert_eq!(content_type, "application/json");
        assert_eq!(String::from_utf8(body).unwrap(), cli, "{spec}");
    }
    // A JSON body is a spec too.
    let json = br#"{"model": "qwen2.5-0.5b", "precision": "bf16", "optimizer": "adamw",
        "batch_size": 2, "seq_len": 512}"#;
    let file = tempfile::NamedTempFile::with_suffix(".json").unwrap();
    std::fs::write(file.path(), json).unwrap();
    let cli = stdout(&headroom(&[
        "estimate",
        &file.path().display().to_string(),
        "--gpu",
        "a100-40gb",
        "--json",
    ]));
    let (status, _, body) = server.request("POST", "/api/estimate?gpu=a100-40gb", json);
    assert_eq!(status, 200);
    assert_eq!(String::from_utf8(body).unwrap(), cli);
}

#[test]
fn bad_input_is_a_400_naming_the_field_as_the_cli_does() {
    let server = Served::start();
    let spec = b"model: qwen2.5-0.5b\nbatch_size: 0\nseq_len: 512\n";
    let file = tempfile::NamedTempFile::with_suffix(".yaml").unwrap();
    std::fs::write(file.path(), spec).unwrap();
    let cli = headroom(&["estimate", &file.path().display().to_string()]);
    assert_eq!(cli.status.code(), Some(2));
    let (status, answer) = server.post("/api/estimate", spec);
    assert_eq!(status, 400);
    let error = &answer["error"];
    assert_eq!(error["field"], "batch_size");
    assert_eq!(error["value"], "0");
    assert!(error["allowed"].as_str().unwrap().contains(">= 1"));
    let message = error["message"].as_str().unwrap();
    assert!(
        String::from_utf8_lossy(&cli.stderr).contains(message),
        "{message}"
    );

    let (status, answer) = server.post("/api/estimate?gpu=h1000", b"model: qwen2.5-0.5b\n");
    assert_eq!(status, 400);
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("h1000")
    );
    let (status, answer) = server.post("/api/estimate", b"model: [unclosed\n");
    assert_eq!(status, 400);
    assert!(answer["error"]["line"].is_number(), "{answer}");
    let (status, answer) = server.post("/api/estimate?format=png", b"model: x\n");
    assert_eq!(
        (status, &answer["error"]["field"]),
        (400, &Value::from("format"))
    );
    let (status, answer) = server.post("/api/fit", b"model: qwen2.5-0.5b\n");
    assert_eq!(
        (status, &answer["error"]["field"]),
        (400, &Value::from("gpu"))
    );
}

#[test]
fn garbage_too_much_and_wrong_methods_get_a_status_and_the_server_stays_up() {
    let server = Served::start();
    let garbage: Vec<u8> = (0..4096u32).map(|i| (i * 7919 % 251) as u8).collect();
    for path in ["/api/estimate", "/api/fit?gpu=h200", "/api/snapshot"] {
        let (status, answer) = server.post(path, &garbage);
        assert_eq!(status, 400, "{path}: {answer}");
        assert!(answer["error"]["message"].is_string());
    }
    let (status, answer) = server.post("/api/diagnose", &garbage);
    assert_eq!(status, 400, "{answer}");
    let too_large = vec![b'#'; (headroom::limits::MAX_FILE_BYTES + 1) as usize];
    let (status, answer) = server.post("/api/estimate", &too_large);
    assert_eq!(status, 413, "{answer}");
    assert_eq!(server.request("GET", "/api/estimate", b"").0, 405);
    assert_eq!(server.request("POST", "/", b"").0, 405);
    assert_eq!(server.request("GET", "/nothing", b"").0, 404);
    assert_eq!(server.request("GET", "/api/estimate?%zz=%", b"").0, 405);
    // Still answering.
    let (status, content_type, page) = server.request("GET", "/", b"");
    assert_eq!(
        (status, content_type.as_str()),
        (200, "text/html; charset=utf-8")
    );
    let page = String::from_utf8(page).unwrap();
    assert!(page.contains("/api/estimate"));
    // Offline: the page names no other host.
    assert!(!page.contains("http://") && !page.contains("//cdn"));
}

/// Reads one answer of a kept-alive connection: its head, then `Content-Length` bytes.
fn read_answer(stream: &mut TcpStream) -> u16 {
    let mut reader = BufReader::new(stream);
    let mut status = String::new();
    reader.read_line(&mut status).expect("a status line");
    let mut length = 0;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).expect("a header");
        if line == "\r\n" {
            break;
        }
        if let Some(n) = line.to_ascii_lowercase().strip_prefix("content-length: ") {
            length = n.trim().parse().expect("a length");
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).expect("the body");
    status
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status")
}

#[test]
fn idle_connections_and_clients_that_leave_hold_no_request_up() {
    let server = Served::start();
    // A browser opens several connections at once and keeps them open between requests:
    // more of them than a small pool has threads, each answered once and left idle.
    let mut idle: Vec<TcpStream> = (0..12)
        .map(|_| TcpStream::connect(&server.addr).expect("connects"))
        .collect();
    for stream in &mut idle {
        stream
            .set_read_timeout(Some(std::time::Duration::from_secs(60)))
            .unwrap();
        let head = format!(
            "GET /api/examples HTTP/1.1\r\nHost: {}\r\n\r\n",
            server.addr
        );
        stream.write_all(head.as_bytes()).unwrap();
    }
    for stream in &mut idle {
        assert_eq!(read_answer(stream), 200);
    }
    // Clients that leave mid-request or before reading their answer.
    for head in [
        "POST /api/estimate HTTP/1.1\r\nContent-Length: 100\r\n\r\nmodel:",
        "GET /api/examples HTTP/1.1\r\n\r\n",
    ] {
        let mut stream = TcpStream::connect(&server.addr).expect("connects");
        stream.write_all(head.as_bytes()).unwrap();
    }
    // A new request is answered at once all the same.
    let (sent, answered) = std::sync::mpsc::channel();
    let addr = server.addr.clone();
    std::thread::spawn(move || {
        let mut stream = TcpStream::connect(&addr).expect("connects");
        let head = format!("GET /api/examples HTTP/1.1\r\nHost: {addr}\r\n\r\n");
        stream.write_all(head.as_bytes()).unwrap();
        let _ = sent.send(read_answer(&mut stream));
    });
    let status = answered
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("an answer within a minute, with idle connections open");
    assert_eq!(status, 200);
    drop(idle);
}

#[test]
fn examples_snapshots_oom_messages_and_fit_answer_as_their_commands() {
    let server = Served::start();
    let (status, content_type, body) = server.request("GET", "/api/examples", b"");
    assert_eq!((status, content_type.as_str()), (200, "application/json"));
    let examples: Value = serde_json::from_slice(&body).unwrap();
    let seed003 = examples
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "seed003-phi3-dpo.yaml")
        .expect("seed003 is an example");
    assert_eq!(
        seed003["text"].as_str().unwrap().as_bytes(),
        read("examples/seed003-phi3-dpo.yaml")
    );

    let snapshot = "bench/snapshots/q05-bf16-adamw.pickle.gz";
    let cli = stdout(&headroom(&["snapshot", snapshot, "--json"]));
    let path = format!("/api/snapshot?name={snapshot}");
    let (status, _, body) = server.request("POST", &path, &read(snapshot));
    assert_eq!(status, 200);
    assert_eq!(String::from_utf8(body).unwrap(), cli);
    let (status, content_type, svg) =
        server.request("POST", &format!("{path}&format=svg"), &read(snapshot));
    assert_eq!((status, content_type.as_str()), (200, "image/svg+xml"));
    roxmltree::Document::parse(std::str::from_utf8(&svg).unwrap()).expect("valid XML");

    let message = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. \
        GPU 0 has a total capacity of 79.18 GiB of which 1.50 GiB is free. Of the allocated \
        memory 70.00 GiB is allocated by PyTorch, and 5.00 GiB is reserved by PyTorch but \
        unallocated.";
    let (status, answer) = server.post("/api/diagnose", message.as_bytes());
    assert_eq!(status, 200);
    assert_eq!(answer["diagnosis"]["cause"], "fragmentation");
    assert_eq!(answer["tried_to_allocate_bytes"], 2u64 << 30);

    let spec = "examples/qwen2.5-7b-lora.yaml";
    let cli: Value = serde_json::from_str(&stdout(&headroom(&[
        "fit",
        spec,
        "--gpu",
        "h100-80gb",
        "--json",
    ])))
    .unwrap();
    let (status, answer) = server.post("/api/fit?gpu=h100-80gb", &read(spec));
    assert_eq!(status, 200);
    assert_eq!(answer, cli);
}

#[test]
fn the_timeline_is_an_svg_in_the_answer() {
    let server = Served::start();
    let spec = read("examples/seed003-phi3-dpo.yaml");
    let (status, content_type, svg) = server.request(
        "POST",
        "/api/estimate?gpu=h100-80gb&format=svg&title=seed003",
        &spec,
    );
    assert_eq!((status, content_type.as_str()), (200, "image/svg+xml"));
    let svg = String::from_utf8(svg).unwrap();
    let doc = roxmltree::Document::parse(&svg).expect("valid XML");
    assert!(doc.descendants().any(|n| {
        n.text()
            .is_some_and(|t| t.trim().starts_with("out of memory in iteration 0"))
    }));
}

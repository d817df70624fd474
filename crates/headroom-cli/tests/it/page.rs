//! The page of `headroom serve` as a person sees it: headless Chromium opens it, runs its
//! script against the server, and the numbers it renders are checked against the CLI's JSON.
//! Screenshots go to target/screenshots (and, with HEADROOM_UPDATE_SCREENSHOTS=1, to
//! docs/screenshots, where the README shows them). Without Chromium the test says so and
//! passes, except in CI (`CI` set), where .ci/run installs it and it must run.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use super::common::{json, repo};
use super::serve::Served;

/// Debian's `chromium`, where installed.
fn chromium() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|dir| ["chromium", "chromium-browser"].map(|name| dir.join(name)))
        .find(|p| p.is_file())
}

/// Seconds a Chromium run may take before it is ended (a run takes 1 to 25 s here; under a
/// loaded machine, a screenshot of a fit's page has stalled for minutes).
const CHROMIUM_TIMEOUT_S: u64 = 150;

/// Headless Chromium on `url`, given time for the page's requests: its DOM once they are done,
/// or a screenshot at `screenshot`.
fn browse(chromium: &Path, url: &str, screenshot: Option<&Path>) -> String {
    for attempt in 1..=2 {
        if let Some(dom) = try_browse(chromium, url, screenshot) {
            return dom;
        }
        eprintln!("chromium on {url}: no answer in {CHROMIUM_TIMEOUT_S} s (attempt {attempt})");
    }
    panic!("chromium on {url}: no answer in two attempts");
}

/// One run of [`browse`]; `None` when it had to be ended.
fn try_browse(chromium: &Path, url: &str, screenshot: Option<&Path>) -> Option<String> {
    let profile = tempfile::tempdir().unwrap();
    let dom = tempfile::NamedTempFile::new().unwrap();
    let errors = tempfile::NamedTempFile::new().unwrap();
    let mut command = Command::new(chromium);
    command.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        "--virtual-time-budget=120000",
    ]);
    // A page at a desktop's size; a picture at its own.
    command.arg(if url.starts_with("file://") {
        "--window-size=1100,520"
    } else {
        "--window-size=1400,1000"
    });
    command.arg(format!("--user-data-dir={}", profile.path().display()));
    match screenshot {
        Some(path) => command.arg(format!("--screenshot={}", path.display())),
        None => command.arg("--dump-dom"),
    };
    let mut child = command
        .arg(url)
        .stdout(dom.reopen().unwrap())
        .stderr(errors.reopen().unwrap())
        .spawn()
        .expect("chromium runs");
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("chromium's status") {
            break status;
        }
        if started.elapsed().as_secs() > CHROMIUM_TIMEOUT_S {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    eprintln!(
        "chromium on {url}: {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert!(
        status.success(),
        "chromium: {}",
        std::fs::read_to_string(errors.path()).unwrap_or_default()
    );
    Some(std::fs::read_to_string(dom.path()).expect("the DOM"))
}

/// The value of `attr` on the element with `id` in a dumped DOM.
fn attr(dom: &str, id: &str, attr: &str) -> Option<String> {
    let at = dom.find(&format!("id=\"{id}\""))?;
    let start = dom[..at].rfind('<')?;
    let end = at + dom[at..].find('>')?;
    let tag = &dom[start..end];
    let key = format!("{attr}=\"");
    let from = tag.find(&key)? + key.len();
    Some(tag[from..from + tag[from..].find('"')?].to_string())
}

/// The text right after the element with `id` opens.
fn text(dom: &str, id: &str) -> Option<String> {
    let at = dom.find(&format!("id=\"{id}\""))?;
    let from = at + dom[at..].find('>')? + 1;
    Some(dom[from..from + dom[from..].find('<')?].to_string())
}

fn bytes(dom: &str, id: &str) -> u64 {
    attr(dom, id, "data-bytes")
        .unwrap_or_else(|| panic!("#{id} not rendered"))
        .parse()
        .expect("bytes")
}

/// A PNG's width and height, read from its header.
fn png_size(path: &Path) -> (u32, u32) {
    let png = std::fs::read(path).expect("the screenshot is written");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let be = |i: usize| u32::from_be_bytes(png[i..i + 4].try_into().unwrap());
    (be(16), be(20))
}

#[test]
fn the_page_shows_what_the_cli_says() {
    let Some(chromium) = chromium() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "chromium is missing in CI; .ci/run installs it (apt-get install chromium)"
        );
        eprintln!("skipped: chromium is not installed (apt-get install chromium)");
        return;
    };
    let server = Served::start();

    // Opened with no arguments: the first example's estimate on the default GPU.
    let dom = browse(&chromium, &server.url("/"), None);
    assert!(
        dom.contains("data-ready=\"1\""),
        "the page's script finished"
    );
    let est = json(&[
        "estimate",
        "examples/qwen2.5-7b-lora.yaml",
        "--gpu",
        "h100-80gb",
        "--json",
    ]);
    assert_eq!(bytes(&dom, "peak-allocated"), est["peak_allocated_bytes"]);
    assert_eq!(bytes(&dom, "peak-reserved"), est["peak_reserved_bytes"]);
    assert_eq!(attr(&dom, "verdict", "data-fits").as_deref(), Some("true"));
    // The timeline is an SVG in the page, before the fit's section.
    let timeline = dom.find("id=\"timeline\"").expect("the timeline");
    let fit_section = dom.find("id=\"fit\"").expect("the fit section");
    assert!(dom[timeline..fit_section].contains("<svg"));

    // seed003 on an H100: out of memory where the CLI says, on the page and in its timeline.
    let url = server.url("/?example=seed003-phi3-dpo.yaml&gpu=h100-80gb");
    let dom = browse(&chromium, &url, None);
    let est = json(&[
        "estimate",
        "examples/seed003-phi3-dpo.yaml",
        "--gpu",
        "h100-80gb",
        "--json",
    ]);
    let oom = &est["gpu"]["oom"];
    assert_eq!(
        attr(&dom, "oom-point", "data-phase").as_deref(),
        oom["phase"].as_str()
    );
    assert_eq!(bytes(&dom, "oom-point"), oom["requested_bytes"]);
    assert_eq!(bytes(&dom, "peak-allocated"), est["peak_allocated_bytes"]);
    assert_eq!(attr(&dom, "verdict", "data-fits").as_deref(), Some("false"));
    let label = format!("out of memory in iteration {}", oom["iteration"]);
    assert!(dom.contains(&label), "the timeline marks it: {label}");

    // Fit, and a pasted OOM message, as their commands answer.
    let url = server.url("/?example=qwen2.5-7b-lora.yaml&gpu=h100-80gb&fit=1");
    let dom = browse(&chromium, &url, None);
    let fit = json(&[
        "fit",
        "examples/qwen2.5-7b-lora.yaml",
        "--gpu",
        "h100-80gb",
        "--json",
    ]);
    assert_eq!(
        text(&dom, "max-micro-batch").map(|t| Value::from(t.parse::<u64>().unwrap())),
        Some(fit["max_micro_batch"].clone())
    );
    let rows = dom.matches("<tr><td>").count();
    assert!(rows > fit["pareto"].as_array().unwrap().len());

    // A bad spec: the error names the field next to the editor.
    let url = server.url("/?spec=model%3A%20qwen2.5-0.5b%0Abatch_size%3A%200%0A");
    let dom = browse(&chromium, &url, None);
    assert_eq!(
        attr(&dom, "spec-error", "data-field").as_deref(),
        Some("batch_size")
    );
    assert!(text(&dom, "spec-error").is_some_and(|t| t.contains("field batch_size (line 2)")));

    // Screenshots a person reads.
    let dir = repo().join("target/screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    let shots = [
        (
            "serve-seed003.png",
            "/?example=seed003-phi3-dpo.yaml&gpu=h100-80gb",
        ),
        (
            "serve-fit.png",
            "/?example=llama-3.1-8b-full.yaml&gpu=h100-80gb&fit=1",
        ),
    ];
    let mut pngs = Vec::new();
    for (name, path) in shots {
        let png = dir.join(name);
        // The page's numbers are checked above; a screenshot that stalls (seen under a loaded
        // machine, with a fit's page) is said and left out rather than failing them.
        if try_browse(&chromium, &server.url(path), Some(&png)).is_none() {
            eprintln!("{name} left out: chromium gave no answer in {CHROMIUM_TIMEOUT_S} s");
            continue;
        }
        assert_eq!(png_size(&png), (1400, 1000));
        pngs.push(png);
    }
    // `estimate --plot`'s SVG as a browser draws it.
    let svg = dir.join("estimate-seed003.svg");
    let args = [
        "estimate",
        "examples/seed003-phi3-dpo.yaml",
        "--gpu",
        "h100-80gb",
        "--plot",
    ];
    let out = super::common::headroom(&[&args[..], &[&svg.display().to_string()]].concat());
    assert!(out.status.success());
    let png = dir.join("estimate-seed003.png");
    browse(&chromium, &format!("file://{}", svg.display()), Some(&png));
    pngs.push(png);
    if std::env::var_os("HEADROOM_UPDATE_SCREENSHOTS").is_some() {
        for png in pngs {
            let name = png.file_name().unwrap();
            std::fs::copy(&png, repo().join("docs/screenshots").join(name)).unwrap();
        }
    }
}

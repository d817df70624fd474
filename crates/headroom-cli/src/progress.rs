//! Progress of work that can take more than a second (`fit`'s search, `validate` over many
//! rows): a spinner on stderr with what is being done and for how long. Only on a terminal
//! and never with `--json`, so that pipes, logs and machine readers see nothing of it.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

/// A spinner saying `message`, ticking until it is dropped or finished; hidden unless
/// stderr is a terminal and the output is not `--json`. `count`, when given, is shown after
/// the message (`count()` things done so far).
pub fn spinner(json: bool, message: &str, count: Option<fn() -> u64>) -> ProgressBar {
    if json || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let template = if count.is_some() {
        "{spinner} {msg}: {count} ({elapsed})"
    } else {
        "{spinner} {msg} ({elapsed})"
    };
    let mut style = ProgressStyle::with_template(template).expect("a valid template");
    if let Some(count) = count {
        style = style.with_key(
            "count",
            move |_: &indicatif::ProgressState, w: &mut dyn std::fmt::Write| {
                let _ = write!(w, "{}", count());
            },
        );
    }
    let bar = ProgressBar::new_spinner();
    bar.set_style(style);
    bar.set_message(message.to_string());
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

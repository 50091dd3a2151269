//! The progress bar of long work (training steps, the repeats of `bench overlap` and `bench
//! buckets`, the measurements of `bench calibrate`), on stderr while it is a terminal and the
//! report is text; in a pipe, or under `--format json`, nothing is drawn, so scripts read the
//! report alone.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

/// A bar of `total` units, or nothing.
pub struct Progress(Option<ProgressBar>);

impl Progress {
    /// A bar counting `total` `unit`s of `what` (e.g. "training", "step"), drawn only when `text`
    /// (the report is text) and stderr is a terminal.
    pub fn new(what: &str, unit: &str, total: u64, text: bool) -> Progress {
        if !text || !std::io::stderr().is_terminal() {
            return Progress(None);
        }
        let template = format!("{{prefix}} {unit} {{pos}}/{{len}} {{wide_bar}} {{elapsed}} (eta {{eta}})");
        let style = ProgressStyle::with_template(&template).unwrap_or_else(|_| ProgressStyle::default_bar());
        let bar = ProgressBar::new(total).with_style(style).with_prefix(what.to_string());
        // Drawn at once, before the first unit ends.
        bar.tick();
        Progress(Some(bar))
    }

    /// Moves the bar to `done` units.
    pub fn set(&self, done: u64) {
        if let Some(bar) = &self.0 {
            bar.set_position(done);
        }
    }

    /// Removes the bar, so that the report follows on a clean line.
    pub fn finish(&self) {
        if let Some(bar) = &self.0 {
            bar.finish_and_clear();
        }
    }
}

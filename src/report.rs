//! How a failed command reports its error: a stable code, the message and its causes, where the
//! bad input is, and how to fix it.
//!
//! The code comes from the first error in the `anyhow` chain that is one of pleat's typed errors
//! (each implements `miette::Diagnostic` with a code `E0xxx` from docs/errors.md); an error with no
//! typed cause gets `E0700`. Three renderings, all on stderr:
//! - text (stderr not a terminal): the first line is always `error[E0xxx]: message`, then
//!   `  caused by:`, `  location:` and `  help:` lines, stable for scripts and tests;
//! - graphical (stderr a terminal): miette's report, quoting and underlining the text when the
//!   error carries it;
//! - JSON (`--format json`): one object `{"error": {"code", "message", "help", "location", "causes"}}`.

use std::error::Error as StdError;
use std::fmt;
use std::io::IsTerminal;

use miette::{Diagnostic, LabeledSpan, SourceCode};
use serde_json::{json, Map, Value};

use crate::usage::UsageError;

/// The code of an error no typed error explains (an I/O failure, a context message).
pub const UNCLASSIFIED: &str = "E0700";

/// The code of a command line the argument parser rejects.
pub const BAD_ARGUMENTS: &str = "E0701";

/// The code of a file the operating system would not let pleat read or write (the message names
/// the file; the cause is the system's reason).
pub const FILE_ACCESS: &str = "E0743";

/// The order of a location's parts in text: the file first, then narrower places.
const ORDER: [&str; 15] = [
    "file",
    "field",
    "line",
    "column",
    "flag",
    "tensor",
    "model",
    "pass",
    "node",
    "name",
    "value",
    "axis",
    "rank",
    "instruction",
    "variable",
];

/// How to print an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorFormat {
    /// Plain text, or miette's graphical report on a terminal.
    Text,
    /// One JSON object.
    Json,
}

/// What the report says about one failure.
pub struct Report<'a> {
    /// The stable code.
    pub code: String,
    /// The outermost message.
    pub message: String,
    /// The messages of the causes, outermost first.
    pub causes: Vec<String>,
    /// How to fix it, when a typed error says.
    pub help: Option<String>,
    /// Where the bad input is: `file`, `field`, `line`, `column`, `node`, `value`, `flag`, ...
    pub location: Map<String, Value>,
    /// The typed error the code came from.
    pub diagnostic: Option<&'a dyn Diagnostic>,
}

impl<'a> Report<'a> {
    /// The report of `error`.
    pub fn of(error: &'a anyhow::Error) -> Report<'a> {
        let mut causes: Vec<String> = error.chain().skip(1).map(ToString::to_string).collect();
        // A typed error whose message its wrapper already repeats adds nothing as a cause.
        causes.dedup();
        let found = error.chain().find_map(|cause| diagnostic_of(cause).map(|diagnostic| (cause, diagnostic)));
        let (code, help, location, diagnostic) = match found {
            Some((cause, diagnostic)) => (
                diagnostic.code().map_or_else(|| UNCLASSIFIED.to_string(), |code| code.to_string()),
                diagnostic.help().map(|help| help.to_string()),
                location_of(cause),
                Some(diagnostic),
            ),
            None if error.chain().any(|cause| cause.downcast_ref::<std::io::Error>().is_some()) => (
                FILE_ACCESS.to_string(),
                Some("check that the path exists and that pleat may read it (or write its directory)".to_string()),
                Map::new(),
                None,
            ),
            None => (UNCLASSIFIED.to_string(), None, Map::new(), None),
        };
        Report { code, message: error.to_string(), causes, help, location, diagnostic }
    }

    /// The plain-text rendering: `error[E0xxx]: message`, then causes, location and help.
    pub fn text(&self) -> String {
        let mut text = format!("error[{}]: {}\n", self.code, self.message);
        for cause in &self.causes {
            text.push_str(&format!("  caused by: {cause}\n"));
        }
        if !self.location.is_empty() {
            // The file first, then narrower places, whatever order the map keeps its keys in.
            let rank = |key: &str| ORDER.iter().position(|known| *known == key).unwrap_or(ORDER.len());
            let mut entries: Vec<(&String, &Value)> = self.location.iter().collect();
            entries.sort_by_key(|(key, _)| rank(key));
            let parts: Vec<String> = entries.iter().map(|(key, value)| format!("{key} {}", plain(value))).collect();
            text.push_str(&format!("  location: {}\n", parts.join(", ")));
        }
        if let Some(help) = &self.help {
            text.push_str(&format!("  help: {help}\n"));
        }
        text
    }

    /// The JSON rendering.
    pub fn json(&self) -> Value {
        crate::json_output::versioned(json!({
            "error": {
                "code": self.code,
                "message": self.message,
                "help": self.help,
                "location": self.location,
                "causes": self.causes,
            }
        }))
    }

    /// miette's graphical rendering, with the outermost message and the typed error's code, help,
    /// labels and source text.
    pub fn graphical(&self) -> String {
        let theme = if std::env::var_os("NO_COLOR").is_some_and(|value| value != "0") {
            miette::GraphicalTheme::unicode_nocolor()
        } else {
            miette::GraphicalTheme::unicode()
        };
        let shown = Shown { report: self };
        let mut out = String::new();
        match miette::GraphicalReportHandler::new_themed(theme).render_report(&mut out, &shown) {
            Ok(()) => out,
            Err(_) => self.text(),
        }
    }
}

/// Prints `error` on stderr in `format` (graphical when text goes to a terminal).
#[allow(clippy::print_stderr, reason = "the binary reports its errors")]
pub fn print(error: &anyhow::Error, format: ErrorFormat) {
    let report = Report::of(error);
    match format {
        ErrorFormat::Json => eprintln!("{}", report.json()),
        ErrorFormat::Text if std::io::stderr().is_terminal() => eprint!("{}", report.graphical()),
        ErrorFormat::Text => eprint!("{}", report.text()),
    }
}

/// The text of a command line the argument parser rejected, with a code: `E0620` for a link that
/// does not parse, `E0701` otherwise. clap's own first line `error: ...` becomes `error[CODE]: ...`.
pub fn clap_text(error: &clap::Error, args: &[std::ffi::OsString]) -> String {
    let code = clap_code(error);
    let rendered = error.render().to_string();
    let mut text = match rendered.strip_prefix("error:") {
        Some(rest) => format!("error[{code}]:{rest}"),
        // `pleat` alone: clap's rendering is the whole help, with no message of its own.
        None => format!("error[{code}]: pleat needs a command\n\n{rendered}"),
    };
    if !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(&format!("  help: {}\n", clap_help(error, args)));
    text
}

/// How to fix a rejected command line: the typed error's help where a flag's value parser gave
/// one (`--emulate-link`'s), else where the command's flags are listed.
fn clap_help(error: &clap::Error, args: &[std::ffi::OsString]) -> String {
    if let Some(help) =
        error.source().and_then(diagnostic_of).and_then(|diagnostic| diagnostic.help().map(|help| help.to_string()))
    {
        return help;
    }
    // The command and a `bench` subcommand, as typed (the parser has not said which it took).
    let words: Vec<String> = args
        .iter()
        .skip(1)
        .map(|arg| arg.to_string_lossy().into_owned())
        .take_while(|word| !word.starts_with('-'))
        .take(2)
        .collect();
    let command = match words.as_slice() {
        [] => return "`pleat --help` lists the commands".to_string(),
        [bench, what] if bench == "bench" => format!("bench {what}"),
        [command, ..] => command.clone(),
    };
    format!("`pleat {command} --help` lists its flags and their values")
}

/// The same rejection as one JSON object, for a command line that asked for `--format json`:
/// clap's first line is the message, its tips and usage the help.
pub fn clap_json(error: &clap::Error, args: &[std::ffi::OsString]) -> Value {
    let rendered = error.render().to_string();
    let rendered = rendered.strip_prefix("error:").unwrap_or(&rendered);
    // The message runs to the first blank line (a missing argument's names follow it); then the
    // fix, then clap's tips and usage.
    let (message, rest) = rendered.split_once("\n\n").unwrap_or((rendered, ""));
    let message: Vec<&str> = message.lines().map(str::trim).filter(|line| !line.is_empty()).collect();
    let help: Vec<String> = std::iter::once(clap_help(error, args))
        .chain(rest.lines().map(str::trim).filter(|line| !line.is_empty()).map(str::to_string))
        .collect();
    let report = Report {
        code: clap_code(error),
        message: message.join(" "),
        help: Some(help.join("\n")),
        location: Map::new(),
        causes: Vec::new(),
        diagnostic: None,
    };
    report.json()
}

/// Whether a command line asks for JSON output (`--format json` or `--format=json`), read from the
/// raw arguments because the parser has rejected them (not necessarily UTF-8: a bad path is one
/// reason it may have).
pub fn asks_for_json(args: &[std::ffi::OsString]) -> bool {
    args.windows(2).any(|pair| pair[0] == "--format" && pair[1] == "json")
        || args.iter().any(|arg| arg == "--format=json")
}

fn clap_code(error: &clap::Error) -> String {
    match error.source() {
        Some(source) => diagnostic_of(source)
            .and_then(|diagnostic| diagnostic.code().map(|code| code.to_string()))
            .unwrap_or_else(|| BAD_ARGUMENTS.to_string()),
        None => BAD_ARGUMENTS.to_string(),
    }
}

/// The typed error `cause` is, as a diagnostic.
fn diagnostic_of<'a>(cause: &'a (dyn StdError + 'static)) -> Option<&'a dyn Diagnostic> {
    macro_rules! first_of {
        ($($ty:ty),* $(,)?) => {
            $(if let Some(typed) = cause.downcast_ref::<$ty>() { return Some(typed); })*
        };
    }
    first_of!(
        UsageError,
        pleat_ir::model::config::ConfigError,
        pleat_ir::Error,
        pleat_ir::text::ParseError,
        pleat_ir::interp::InterpError,
        pleat_ir::interp::OpError,
        pleat_ir::optim::OptimError,
        pleat_passes::Error,
        pleat_passes::VerifierErrors,
        pleat_passes::VerifierError,
        pleat_passes::autodiff::AutodiffError,
        pleat_passes::autodiff::reference::ReferenceError,
        pleat_passes::pipeline::ScheduleError,
        pleat_passes::search::SearchError,
        pleat_passes::cost::CostError,
        pleat_backend::Error,
        pleat_runtime::Error,
        pleat_runtime::weights::WeightError,
        pleat_runtime::comm::CommError,
        pleat_runtime::comm::LinkSpecError,
        pleat_runtime::kernels::KernelError,
        pleat_runtime::native::NativeError,
    );
    #[cfg(feature = "llvm")]
    first_of!(pleat_backend::llvm::LlvmError);
    #[cfg(feature = "mpi")]
    first_of!(pleat_runtime::comm::MpiInitError);
    None
}

/// Where the input at fault is, for the typed errors that know.
fn location_of(cause: &(dyn StdError + 'static)) -> Map<String, Value> {
    use pleat_ir::interp::InterpError;
    use pleat_ir::model::config::ConfigError;
    use pleat_passes::autodiff::AutodiffError;
    use pleat_passes::pipeline::ScheduleError;

    let mut at = Map::new();
    let mut put = |key: &str, value: Value| {
        at.insert(key.to_string(), value);
    };
    if let Some(error) = cause.downcast_ref::<UsageError>() {
        for (key, value) in error.location() {
            put(key, json!(value));
        }
    } else if let Some(error) = cause.downcast_ref::<ConfigError>() {
        let (file, field) = match error {
            ConfigError::MalformedJson { file, line, column, .. } => {
                put("line", json!(line));
                put("column", json!(column));
                (Some(file), None)
            }
            ConfigError::NotAnObject { file, .. } | ConfigError::TooManyParameters { file } => (Some(file), None),
            ConfigError::HeadsNotDivisible { file, .. } => (Some(file), Some("num_key_value_heads")),
            ConfigError::HeadDimNotDerivable { file, .. } => (Some(file), Some("hidden_size")),
            ConfigError::OddHeadDim { file, .. } => (Some(file), Some("head_dim")),
            ConfigError::MissingField { file, field }
            | ConfigError::BadField { file, field, .. }
            | ConfigError::BadValue { file, field, .. }
            | ConfigError::UnknownArchitecture { file, field, .. }
            | ConfigError::UnsupportedRopeType { file, field, .. }
            | ConfigError::Unsupported { file, field, .. } => (Some(file), Some(field.as_str())),
            ConfigError::UnknownPreset { .. } => (None, None),
        };
        if let Some(file) = file {
            put("file", json!(file));
        }
        if let Some(field) = field {
            put("field", json!(field));
        }
    } else if let Some(error) = cause.downcast_ref::<pleat_ir::text::ParseError>() {
        put("line", json!(error.line));
        put("column", json!(error.column));
    } else if let Some(error) = cause.downcast_ref::<pleat_ir::Error>() {
        match error {
            pleat_ir::Error::Indivisible { node, axis, .. } => {
                put("node", json!(node));
                put("axis", json!(axis));
            }
            pleat_ir::Error::UnsupportedModel { model, .. } => put("model", json!(model)),
            _ => put("flag", json!("--mesh")),
        }
    } else if let Some(error) = cause.downcast_ref::<InterpError>() {
        match error {
            InterpError::MissingOutput { value } => put("value", json!(value.to_string())),
            InterpError::Undefined { node, value, .. } => {
                put("node", json!(node.to_string()));
                put("value", json!(value.to_string()));
            }
            InterpError::Sharded { node, .. }
            | InterpError::ResultShape { node, .. }
            | InterpError::InputLength { node, .. }
            | InterpError::InputTooLarge { node, .. }
            | InterpError::MissingParam { node, .. }
            | InterpError::ParamLength { node, .. }
            | InterpError::Op { node, .. } => put("node", json!(node.to_string())),
        }
    } else if let Some(errors) = cause.downcast_ref::<pleat_passes::VerifierErrors>() {
        if let Some(first) = errors.errors.first() {
            put("node", json!(first.node.to_string()));
        }
    } else if let Some(error) = cause.downcast_ref::<pleat_passes::VerifierError>() {
        put("node", json!(error.node.to_string()));
    } else if let Some(error) = cause.downcast_ref::<pleat_passes::Error>() {
        match error {
            // Transparent wrappers: the wrapped error knows the place.
            pleat_passes::Error::Ir(inner) => return location_of(inner),
            pleat_passes::Error::Autodiff(inner) => return location_of(inner),
            pleat_passes::Error::NoLayout { node, .. } => put("node", json!(node.to_string())),
            pleat_passes::Error::Verify { pass, errors } => {
                put("pass", json!(pass));
                if let Some(first) = errors.errors.first() {
                    put("node", json!(first.node.to_string()));
                }
            }
            pleat_passes::Error::UnknownPass { .. } => put("flag", json!("--dump-after")),
            pleat_passes::Error::ZigzagSeq { axis, .. } => {
                put("flag", json!("--seq"));
                put("axis", json!(axis));
            }
            _ => {}
        }
    } else if let Some(error) = cause.downcast_ref::<AutodiffError>() {
        match error {
            AutodiffError::UnknownLoss { value } | AutodiffError::NotCrossEntropy { value, .. } => {
                put("value", json!(value.to_string()));
            }
            AutodiffError::NoRule { node, .. } => put("node", json!(node.to_string())),
            AutodiffError::NoLayout { name, .. } | AutodiffError::UnusedParam { name } => put("name", json!(name)),
        }
    } else if let Some(error) = cause.downcast_ref::<ScheduleError>() {
        match error {
            ScheduleError::PpLayersEntry { .. }
            | ScheduleError::PpLayersCount { .. }
            | ScheduleError::PpLayersSum { .. } => {
                put("flag", json!("--pp-layers"));
            }
            ScheduleError::TooFewChunks { .. } => put("flag", json!("--chunks")),
            ScheduleError::MicroBatchesNotDivisible { .. } => put("flag", json!("--micro-batches")),
            _ => {}
        }
    } else if let Some(error) = cause.downcast_ref::<pleat_runtime::weights::WeightError>() {
        use pleat_runtime::weights::WeightError;
        match error {
            WeightError::FileMissing { path }
            | WeightError::Malformed { path, .. }
            | WeightError::WriteFailed { path, .. } => {
                put("file", json!(path.display().to_string()));
            }
            WeightError::NoCheckpointInDirectory { dir } => put("file", json!(dir.display().to_string())),
            WeightError::IndexedFileMissing { path, .. } => put("file", json!(path.display().to_string())),
            WeightError::TensorMissing { name, file, .. }
            | WeightError::NotCovered { name, file, .. }
            | WeightError::ShapeMismatch { name, file, .. }
            | WeightError::UnsupportedDtype { name, file, .. }
            | WeightError::NotFinite { name, file, .. } => {
                put("file", json!(file.display().to_string()));
                put("tensor", json!(name));
            }
            WeightError::NotResident { name, .. }
            | WeightError::RegionOutOfBounds { name, .. }
            | WeightError::InvalidTensorToWrite { name, .. } => put("tensor", json!(name)),
        }
    } else if let Some(error) = cause.downcast_ref::<pleat_runtime::Error>() {
        use pleat_runtime::Error;
        match error {
            Error::Kernel { rank, instr, .. }
            | Error::Comm { rank, instr, .. }
            | Error::Cuda { rank, instr, .. }
            | Error::Program { rank, instr, .. } => {
                put("rank", json!(rank));
                put("instruction", json!(instr));
            }
            Error::Weight { rank, source } => {
                put("rank", json!(rank));
                // (And the tensor and file the loader names.)
                for (key, value) in location_of(source.as_ref()) {
                    put(&key, value);
                }
            }
            Error::Panicked { rank, .. } => put("rank", json!(rank)),
            Error::NoCudaDevice { .. } => put("flag", json!("--device")),
            // (`--mesh` for a run, `--ranks` for `pleat bench comm`: the message names the count.)
            Error::TooManyThreadRanks { .. } => {}
            Error::Diverged { rank, .. } => {
                put("rank", json!(rank));
                put("flag", json!("--lr"));
            }
            Error::Inputs { .. } => {}
        }
    } else if let Some(error) = cause.downcast_ref::<pleat_backend::Error>() {
        match error {
            pleat_backend::Error::Indivisible { value, .. } | pleat_backend::Error::SplitLossDim { value, .. } => {
                put("value", json!(value));
            }
            pleat_backend::Error::Inconsistent { instr, .. } => put("instruction", json!(instr)),
            _ => {}
        }
    } else if cause.downcast_ref::<pleat_runtime::comm::LinkSpecError>().is_some() {
        put("flag", json!("--emulate-link"));
    }
    at
}

/// A JSON value as plain text: strings without their quotes.
fn plain(value: &Value) -> String {
    match value {
        Value::String(text) => text.clone(),
        other => other.to_string(),
    }
}

/// The report as one diagnostic for miette's graphical handler.
struct Shown<'a> {
    report: &'a Report<'a>,
}

impl fmt::Debug for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.report.message)
    }
}

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.report.message)?;
        for cause in &self.report.causes {
            write!(f, "\n  caused by: {cause}")?;
        }
        Ok(())
    }
}

impl StdError for Shown<'_> {}

impl Diagnostic for Shown<'_> {
    fn code<'b>(&'b self) -> Option<Box<dyn fmt::Display + 'b>> {
        Some(Box::new(&self.report.code))
    }

    fn help<'b>(&'b self) -> Option<Box<dyn fmt::Display + 'b>> {
        self.report.help.as_ref().map(|help| Box::new(help) as Box<dyn fmt::Display>)
    }

    fn source_code(&self) -> Option<&dyn SourceCode> {
        self.report.diagnostic.and_then(|diagnostic| diagnostic.source_code())
    }

    fn labels(&self) -> Option<Box<dyn Iterator<Item = LabeledSpan> + '_>> {
        // Labels without the text they point into would render as bare offsets.
        let diagnostic = self.report.diagnostic?;
        diagnostic.source_code()?;
        diagnostic.labels()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_error_has_its_code_file_and_field_through_context() {
        let config = pleat_ir::model::config::ConfigError::MissingField {
            file: "/models/x/config.json".into(),
            field: "vocab_size".into(),
        };
        let error = anyhow::Error::new(config).context("cannot load the model");
        let report = Report::of(&error);
        assert_eq!(report.code, "E0103");
        assert_eq!(report.message, "cannot load the model");
        assert_eq!(report.location["file"], "/models/x/config.json");
        assert_eq!(report.location["field"], "vocab_size");
        let text = report.text();
        assert!(
            text.starts_with("error[E0103]: cannot load the model\n  caused by: /models/x/config.json: missing"),
            "{text}"
        );
        assert!(text.contains("\n  location: file /models/x/config.json, field vocab_size\n"), "{text}");
        assert!(text.contains("\n  help: "), "{text}");
        assert_eq!(report.json()["error"]["code"], "E0103");
    }

    #[test]
    fn a_file_the_system_refuses_has_its_code() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory");
        let error = anyhow::Error::new(io).context("cannot read --data /nonexistent");
        let report = Report::of(&error);
        assert_eq!(report.code, FILE_ACCESS);
        assert!(
            report.text().starts_with(
                "error[E0743]: cannot read --data /nonexistent
"
            ),
            "{}",
            report.text()
        );
        assert!(report.text().contains("\n  help: check that the path exists"), "{}", report.text());
    }

    #[test]
    fn an_untyped_error_is_unclassified() {
        let error = anyhow::anyhow!("something odd");
        let report = Report::of(&error);
        assert_eq!(report.code, UNCLASSIFIED);
        assert_eq!(report.text(), "error[E0700]: something odd\n");
        assert!(report.json()["error"]["help"].is_null());
    }

    #[test]
    fn the_graphical_report_quotes_the_ir_text() {
        let text = "; module m mesh=tp=2\nv0: f32[seq=4] = rms_nrom(v0, v0)\n";
        let Err(parse) = pleat_ir::text::parse_module(text) else { panic!("the text is invalid") };
        let error = anyhow::Error::new(parse);
        let report = Report::of(&error);
        assert_eq!(report.code, "E0301");
        assert!(report.location.contains_key("line"));
        let rendered = report.graphical();
        assert!(rendered.contains("E0301"), "{rendered}");
        assert!(rendered.contains("f32[seq=4]"), "{rendered}");
    }
}

//! The bad-input catalogue: every kind of input pleat reads, broken on purpose, must fail with its
//! stable code (docs/errors.md), a message naming the problem, a help line, and never a panic.
//!
//! Each case runs the `pleat` binary and checks its exit status, that the first line of stderr is
//! `error[CODE]: ...`, a substring of the message, and the help line; a few also run with
//! `--format json` and read the error object. The text IR is not read by the command line, so its
//! cases drive the parser through the library and check its diagnostic.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

#[path = "support/cli.rs"]
mod cli;

use cli::{pleat, stdout_of, tempdir, TempDir};

/// One bad input and what pleat must say about it.
struct Case {
    /// The command line.
    args: Vec<String>,
    /// The stable code.
    code: &'static str,
    /// A substring of the report.
    says: String,
}

fn case(args: &[&str], code: &'static str, says: &str) -> Case {
    Case { args: args.iter().map(|arg| arg.to_string()).collect(), code, says: says.to_string() }
}

/// Runs `case` and checks the report; returns stderr.
#[track_caller]
fn check(case: &Case) -> String {
    let args: Vec<&str> = case.args.iter().map(String::as_str).collect();
    let output = pleat(&args);
    let stderr = String::from_utf8(output.stderr).expect("utf-8");
    let expected_exit = if case.code == "E0701" || case.code == "E0620" { 2 } else { 1 };
    assert_eq!(output.status.code(), Some(expected_exit), "pleat {args:?}: exit status\n{stderr}");
    assert!(!stderr.contains("panicked at"), "pleat {args:?} panicked:\n{stderr}");
    let first = stderr.lines().next().unwrap_or_default();
    assert!(first.starts_with(&format!("error[{}]: ", case.code)), "pleat {args:?}: expected {}:\n{stderr}", case.code);
    assert!(stderr.contains(&case.says), "pleat {args:?}: expected {:?} in\n{stderr}", case.says);
    // A command line the parser rejects has its help line too (it had only clap's pointer).
    assert!(stderr.contains("\n  help: "), "pleat {args:?}: no help line\n{stderr}");
    if expected_exit == 2 {
        assert!(stderr.contains("--help"), "pleat {args:?}: no pointer to --help\n{stderr}");
    }
    stderr
}

/// Runs `args` with `--format json` and returns the error object.
#[track_caller]
fn json_error(args: &[&str]) -> serde_json::Value {
    let mut args = args.to_vec();
    args.extend(["--format", "json"]);
    let output = pleat(&args);
    assert_eq!(output.status.code(), Some(1), "pleat {args:?}");
    let stderr = String::from_utf8(output.stderr).expect("utf-8");
    let value: serde_json::Value =
        serde_json::from_str(stderr.trim()).unwrap_or_else(|err| panic!("pleat {args:?}: not json ({err}):\n{stderr}"));
    value["error"].clone()
}

fn path_str(path: &Path) -> String {
    path.to_str().expect("utf-8 path").to_string()
}

/// A scratch directory with the tiny model compiled for tp=2, shared by the cases that read it.
fn compiled_tiny() -> &'static Path {
    // A static is never dropped: this directory (one a run of this binary) stays behind.
    static DIR: OnceLock<TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempdir("errors-compiled");
        let output =
            pleat(&["compile", "tiny", "--mesh", "tp=2", "--batch", "1", "--seq", "8", "--out", &path_str(&dir)]);
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        dir
    })
}

/// A copy of the compiled tiny directory in `name`, for a case to damage.
fn compiled_copy(name: &str) -> TempDir {
    let source = compiled_tiny();
    let copy = tempdir(&format!("errors-{name}"));
    for entry in std::fs::read_dir(source).expect("compiled dir") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), copy.join(entry.file_name())).expect("copy");
    }
    copy
}

/// The tiny model's config.json (from the compiled directory) with `edit` applied, written to
/// `<name>.json` in `dir`.
fn config_with(dir: &Path, name: &str, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) -> String {
    let text = std::fs::read_to_string(compiled_tiny().join("config.json")).expect("config.json");
    let mut value: serde_json::Value = serde_json::from_str(&text).expect("json");
    edit(value.as_object_mut().expect("an object"));
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_string_pretty(&value).expect("json")).expect("write");
    path_str(&path)
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write");
    path_str(&path)
}

#[test]
fn model_configs() {
    let dir = tempdir("errors-config");
    let missing = config_with(&dir, "missing", |config| {
        config.remove("vocab_size");
    });
    let zero_heads = config_with(&dir, "zero-heads", |config| {
        config.insert("num_attention_heads".into(), 0.into());
    });
    let hidden = config_with(&dir, "hidden", |config| {
        config.remove("head_dim");
        config.insert("hidden_size".into(), 100.into());
    });
    let kv = config_with(&dir, "kv", |config| {
        config.insert("num_key_value_heads".into(), 3.into());
    });
    let arch = config_with(&dir, "arch", |config| {
        config.insert("architectures".into(), serde_json::json!(["GPT2LMHeadModel"]));
    });
    let wrong_type = config_with(&dir, "type", |config| {
        config.insert("hidden_size".into(), "big".into());
    });
    let odd = config_with(&dir, "odd", |config| {
        config.insert("head_dim".into(), 7.into());
    });
    let malformed = write(&dir, "config.json", "{\n  \"hidden_size\": 64,\n  \"vocab_size\" 256\n}\n");
    let not_object = write(&dir, "list.json", "[1, 2]");
    // Not UTF-8: its parser says where (it was an I/O error, "check the path and permissions").
    let binary = dir.join("binary.json");
    std::fs::write(&binary, b"{\n  \"hidden_size\": \xff\n}\n").expect("write");
    let binary = path_str(&binary);
    let cases = [
        case(&["plan", &binary], "E0101", ":2:"),
        case(&["plan", &missing], "E0103", "missing required field `vocab_size`"),
        case(&["plan", &zero_heads], "E0105", "num_attention_heads"),
        case(&["plan", &hidden], "E0110", "hidden_size = 100 is not divisible"),
        case(&["plan", &kv], "E0109", "not a multiple of num_key_value_heads = 3"),
        case(&["plan", &arch], "E0106", "GPT2LMHeadModel"),
        case(&["plan", &wrong_type], "E0104", "field `hidden_size` must be"),
        case(&["plan", &odd], "E0111", "head_dim = 7 is odd"),
        case(&["plan", &malformed], "E0101", ":3:"),
        case(&["plan", &not_object], "E0102", "json object"),
    ];
    for case in &cases {
        check(case);
    }
    let error = json_error(&["plan", &missing]);
    assert_eq!(error["code"], "E0103");
    assert_eq!(error["location"]["file"], missing.as_str());
    assert_eq!(error["location"]["field"], "vocab_size");
    assert!(error["help"].as_str().is_some_and(|help| !help.is_empty()), "{error}");
    let error = json_error(&["plan", &kv]);
    assert_eq!(error["code"], "E0109");
    assert_eq!(error["location"]["field"], "num_key_value_heads");
    let error = json_error(&["plan", &malformed]);
    assert_eq!(error["code"], "E0101");
    assert_eq!(error["location"]["line"], 3);
    assert!(error["location"]["column"].as_u64().is_some(), "{error}");
}

#[test]
fn meshes_and_strategies() {
    let cases = [
        case(&["plan", "llama2-7b", "--mesh", "tp=6"], "E0210", "32 heads are not divisible by tp=6"),
        case(&["explain", "tiny", "--mesh", "tp=3"], "E0206", "not divisible by tp=3"),
        case(&["plan", "tiny", "--mesh", "tq=2"], "E0202", "unknown axis `tq`"),
        case(&["plan", "tiny", "--mesh", "tp=0"], "E0205", "mesh axis tp has size 0"),
        case(&["plan", "tiny", "--mesh", "tp=2,tp=2"], "E0204", "mesh axis tp appears twice"),
        case(&["plan", "tiny", "--mesh", "tp=99999999999,dp=99999999999"], "E0203", "more than pleat addresses"),
        case(&["plan", "tiny", "--mesh", "tp=two"], "E0201", "write axes as name=size"),
        case(&["run", "tiny", "--mesh", "pp=2,tp=2", "--seq", "8", "--batch", "2"], "E0215", "add --train"),
        case(&["explain", "tiny", "--mesh", "dp=2", "--strategy", "tp"], "E0213", "--strategy tp needs the tp axis"),
        case(&["explain", "tiny", "--mesh", "cp=2", "--seq", "6"], "E0208", "zigzag chunks"),
        case(&["explain", "tiny", "--mesh", "cp=2", "--seq", "7"], "E0208", "multiple of 4 (e.g. 8)\n"),
        case(&["explain", "tiny", "--mesh", "tp=2,tsp=2"], "E0209", "both split the weights"),
        // The degrees offered pass every check on the axis, not only the one that failed: tsp=3
        // makes zigzag chunks of seq 6 but does not split 4 kv heads.
        case(&["explain", "tiny", "--mesh", "tsp=4", "--seq", "6"], "E0208", "or tsp in {1}\n"),
        case(&["explain", "tiny", "--mesh", "tsp=3", "--seq", "6"], "E0206", "use tsp in {1}\n"),
        case(&["explain", "tiny", "--mesh", "tp=4", "--seq", "6", "--strategy", "tp-sp"], "E0206", "use tp in {1,2}\n"),
        // Beside cp, sequence parallelism splits each cp rank's tokens over tp.
        case(
            &["explain", "tiny", "--mesh", "tp=4,cp=2", "--seq", "20", "--strategy", "tp-sp"],
            "E0206",
            "10 tokens a cp rank (seq=20 over cp=2) are not divisible by tp=4; use tp in {1,2}\n",
        ),
        // dp and ep split the batch together, in either order on the mesh.
        case(
            &["explain", "tiny-moe", "--mesh", "ep=2,dp=2", "--batch", "2"],
            "E0206",
            "1 sequences (a rank's share of batch 2 over ep=2) are not divisible by dp=2; use dp in {1}",
        ),
        case(
            &["explain", "tiny-moe", "--mesh", "dp=2,ep=2", "--batch", "2"],
            "E0206",
            "over dp=2) are not divisible by ep=2; use ep in {1}",
        ),
        // Programs index a batch's tokens with 32 bits; a batch too large for this machine is
        // refused before its token ids are made; a step beyond 2^53 tokens before it is costed.
        case(&["run", "tiny", "--seq", "4294967296"], "E0114", "batch=8 seq=4294967296: more than 2^32 - 1 tokens"),
        case(&["explain", "tiny", "--batch", "4294967295", "--seq", "4294967295"], "E0114", "more than 2^32 - 1"),
        case(&["run", "tiny", "--batch", "1", "--seq", "4294967295"], "E0747", "running 1 ranks' programs needs"),
        case(
            &["plan", "llama3-405b", "--mesh", "dp=128,pp=16,tp=8", "--seq", "4294967295", "--batch", "4294967295"],
            "E0247",
            "more than the 2^53 tokens a step",
        ),
        case(&["run", "tiny", "--train", "--data", "/nonexistent/tokens.txt"], "E0743", "cannot read --data"),
        case(&["explain", "tiny", "--mesh", "tp=2", "--layer", "99"], "E0703", "--layer 99 does not exist"),
        case(&["explain", "tiny", "--mesh", "tp=2", "--value", "layer0.nope"], "E0704", "no value named layer0.nope"),
    ];
    for case in &cases {
        check(case);
    }
    let error = json_error(&["plan", "tiny", "--mesh", "tq=2"]);
    assert_eq!(error["code"], "E0202");
    assert_eq!(error["location"]["flag"], "--mesh");
    assert!(error["message"].as_str().is_some_and(|message| message.contains("unknown axis")), "{error}");
    let error = json_error(&["explain", "tiny", "--mesh", "tp=3"]);
    assert_eq!(error["code"], "E0206");
    assert!(error["location"]["node"].is_string(), "{error}");
}

#[test]
fn flags_schedules_and_hardware() {
    let dir = tempdir("errors-flags");
    let hw = write(&dir, "hw.toml", "this is not a hardware spec");
    let cases = [
        case(&["run", "tiny", "--emulate-link", "abc"], "E0620", "is not a link"),
        case(&["run", "tiny", "--emulate-link", "0,5"], "E0620", "bandwidth must be a positive"),
        case(&["plan", "tiny", "--no-such-flag"], "E0701", "--no-such-flag"),
        case(&["schedule", "--pp", "4", "--micro-batches", "8", "--chunks", "2"], "E0710", "--chunks 2 applies to"),
        case(
            &["schedule", "--pp", "4", "--micro-batches", "6", "--schedule", "interleaved"],
            "E0222",
            "not a multiple of pp=4",
        ),
        // (Each used to be killed for memory.)
        case(&["bench", "comm", "--ranks", "100000", "--sizes", "4B"], "E0623", "more than the threads communicator"),
        case(&["schedule", "--pp", "100000", "--micro-batches", "100000"], "E0234", "use fewer micro-batches"),
        case(&["compare", "tiny", "--ranks", "0"], "E0708", "--ranks 0"),
        // (Each used to count every number up to the flag's value, for hours near 2^64.)
        case(&["compare", "tiny", "--ranks", "18446744073709551615"], "E0711", "more than pleat addresses (16777216)"),
        case(&["search", "tiny", "--gpus", "16777217"], "E0235", "--gpus 16777217 is more than pleat addresses"),
        // Counts of at least 1 and finite numbers, checked as the flags are read: each used to
        // fail later, as a pleat bug (--steps 0), a NaN gradient norm (--lr nan), no clipping at
        // all (--max-grad-norm nan), a wrong flag named (--chunks 0) or a run with nothing in it.
        case(&["run", "tiny", "--train", "--steps", "0"], "E0701", "'0' for '--steps"),
        case(&["run", "tiny", "--train", "--lr", "nan"], "E0701", "nan is not a finite number"),
        // (A timeout of 0 failed every collective, as a peer that did not arrive.)
        case(&["run", "tiny", "--mesh", "tp=2", "--timeout", "0"], "E0701", "'0' for '--timeout"),
        case(&["bench", "comm", "--ranks", "2", "--sizes", "4B", "--timeout", "0"], "E0701", "'0' for '--timeout"),
        // A diverged step is its own error, not one of the inputs (whose help did not fit).
        case(&["run", "tiny", "--train", "--steps", "3", "--lr", "1e10"], "E0609", "the step diverged"),
        case(&["run", "tiny", "--train", "--lr=-1"], "E0701", "-1 is not above 0"),
        case(&["run", "tiny", "--train", "--max-grad-norm", "inf"], "E0701", "inf is not a finite number"),
        case(
            &["run", "tiny", "--train", "--mesh", "pp=2", "--schedule", "interleaved", "--chunks", "0"],
            "E0701",
            "'0' for '--chunks",
        ),
        case(&["compare", "tiny", "--ranks", "4", "--seq", "4096,0"], "E0701", "'0' for '--seq"),
        case(&["search", "tiny", "--gpus", "4", "--top", "0"], "E0701", "'0' for '--top"),
        // (Each was run once, as 1.)
        case(&["bench", "overlap", "tiny", "--emulate-link", "5,5", "--repeats", "0"], "E0701", "'0' for '--repeats"),
        case(&["bench", "buckets", "tiny", "--emulate-link", "5,5", "--repeats", "0"], "E0701", "'0' for '--repeats"),
        // (The first ran as without it; the second printed "103.1% hidden" of no transfer.)
        case(
            &["bench", "overlap", "tiny", "--mesh", "tsp=2", "--emulate-link", "5,5", "--no-overlap"],
            "E0756",
            "--no-overlap has no meaning here",
        ),
        case(&["bench", "overlap", "tiny", "--mesh", "tsp=1", "--emulate-link", "5,5"], "E0757", "make no transfer"),
        case(&["search", "tiny", "--gpus", "4", "--mem-cap", "nan"], "E0701", "nan is not a finite number"),
        case(&["plan", "tiny", "--hw", "abacus"], "E0244", "unknown hardware `abacus`"),
        case(&["plan", "tiny", "--hw-file", &hw], "E0245", &hw),
        case(&["plan", "tiny", "--train", "--zero", "5"], "E0243", "zero stage 5"),
        case(&["plan", "tiny", "--mesh", "pp=4"], "E0212", "pp=4 is more than the model's"),
        case(&["run", "tiny", "--train", "--mesh", "pp=2", "--pp-layers", "1,x"], "E0231", "--pp-layers 1,x"),
        case(&["run", "tiny", "--train", "--mesh", "pp=2", "--pp-layers", "1,1,1"], "E0232", "3 entries for 2 stages"),
        case(&["bench", "comm", "--sizes", "4KiB..1KiB"], "E0712", "--sizes 4KiB..1KiB"),
        case(&["bench", "comm", "--sizes", "4XB"], "E0714", "unknown unit"),
        // (Measured as one f32 a rank, as 4B is.)
        case(&["bench", "comm", "--sizes", "1B"], "E0713", "a size under 4 bytes"),
        case(&["bench", "comm", "--sizes", "0"], "E0713", "a size under 4 bytes"),
    ];
    for case in &cases {
        check(case);
    }
}

/// A command line the argument parser rejects is one JSON object too when it asks for
/// `--format json`: the parser's first line the message, its tips and usage the help.
#[test]
fn argument_parser_errors_are_json_under_format_json() {
    for (args, code, message) in [
        (&["plan", "tiny", "--format", "json", "--no-such-flag"][..], "E0701", "unexpected argument '--no-such-flag'"),
        (&["run", "tiny", "--format=json", "--emulate-link", "abc"][..], "E0620", "is not a link"),
        (&["compare", "tiny", "--ranks", "4", "--seq", "0", "--format", "json"][..], "E0701", "'0' for '--seq"),
    ] {
        let output = pleat(args);
        assert_eq!(output.status.code(), Some(2), "pleat {args:?}");
        let stderr = String::from_utf8(output.stderr).expect("utf-8");
        let value: serde_json::Value = serde_json::from_str(stderr.trim())
            .unwrap_or_else(|err| panic!("pleat {args:?}: not json ({err}):\n{stderr}"));
        let error = &value["error"];
        assert_eq!(error["code"], code, "{value}");
        assert!(error["message"].as_str().is_some_and(|text| text.contains(message)), "{value}");
        assert!(error["help"].as_str().is_some_and(|help| help.contains("--help")), "{value}");
    }
}

/// An argument that is not UTF-8 is a parser error too, as JSON when asked for, never a panic
/// (`std::env::args` panics on one; the arguments are read as `OsString`).
#[cfg(unix)]
#[test]
fn a_non_utf8_argument_is_a_parser_error_not_a_panic() {
    use std::os::unix::ffi::OsStrExt;
    let model = std::ffi::OsStr::from_bytes(b"\xff");
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_pleat"))
        .args(["plan".as_ref(), model, "--format".as_ref(), "json".as_ref(), "--bogus".as_ref()])
        .env("NO_COLOR", "1")
        .output()
        .expect("pleat runs");
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let stderr = String::from_utf8(output.stderr).expect("utf-8");
    let value: serde_json::Value =
        serde_json::from_str(stderr.trim()).unwrap_or_else(|err| panic!("not json ({err}):\n{stderr}"));
    assert_eq!(value["error"]["code"], "E0701", "{value}");
}

#[test]
fn compiled_directories() {
    let tampered = compiled_copy("tampered");
    let module = tampered.join("module.pleat");
    let mut text = std::fs::read_to_string(&module).expect("module.pleat");
    text.push_str("; an edit\n");
    std::fs::write(&module, text).expect("write");
    let missing = compiled_copy("missing-rank");
    std::fs::remove_file(missing.join("rank1.program")).expect("remove");
    let version = compiled_copy("version");
    let plan_path = version.join("plan.json");
    let mut plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan_path).expect("plan.json")).expect("json");
    plan["format_version"] = 999.into();
    std::fs::write(&plan_path, plan.to_string()).expect("write");
    let garbled = compiled_copy("garbled");
    std::fs::write(garbled.join("plan.json"), "{ not json").expect("write");
    let compiled = path_str(compiled_tiny());
    let plans = tempdir("errors-search-plans");
    let not_json = write(&plans, "not-json.json", "{ not json");
    let old_plan = path_str(&plans.join("old.json"));
    let output = pleat(&["search", "tiny", "--gpus", "2", "--seq", "64", "--emit-plan", &old_plan]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let mut plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&old_plan).expect("plan")).expect("json");
    // Fields `pleat search` cannot have written: each was compiled as given (zero 7 trained as
    // ZeRO-3) or failed later under a flag the user never gave.
    let edited = |name: &str, key: &str, value: serde_json::Value| -> String {
        let mut edited = plan.clone();
        edited[key] = value;
        write(&plans, name, &edited.to_string())
    };
    let zero7 = edited("zero7.json", "zero", 7.into());
    let no_micro_batches = edited("no-micro-batches.json", "micro_batches", 0.into());
    let dp_not_mesh = edited("dp-not-mesh.json", "dp", 4.into());
    plan["format_version"] = 999.into();
    std::fs::write(&old_plan, plan.to_string()).expect("write");
    let out = path_str(&plans.join("out"));
    let cases = [
        case(&["compile", "tiny", "--train", "--out", &out, "--plan", &zero7], "E0523", "zero is 7"),
        case(&["compile", "tiny", "--out", &out, "--plan", &no_micro_batches], "E0523", "micro_batches 0"),
        case(&["compile", "tiny", "--out", &out, "--plan", &dp_not_mesh], "E0523", "dp is 4, and its mesh"),
        case(&["compile", "tiny", "--out", &out, "--plan", &not_json], "E0523", "is not a pleat search plan"),
        case(&["compile", "tiny", "--out", &out, "--plan", &old_plan], "E0524", "plan format 999"),
        case(&["run", &path_str(&tampered)], "E0521", "the directory was changed after `pleat compile`"),
        case(&["run", &path_str(&missing)], "E0522", "rank1.program"),
        case(&["run", &path_str(&version)], "E0520", "plan format 999"),
        case(&["run", &path_str(&garbled)], "E0523", "is not a pleat plan"),
        case(&["run", &compiled, "--seq", "16"], "E0707", "--seq 16 differs from the compiled plan's 8"),
        // The directory's programs run: another mesh or strategy is refused, not ignored.
        case(&["run", &compiled, "--mesh", "dp=2"], "E0707", "--mesh dp=2 differs from the compiled plan's tp=2"),
        case(&["run", &compiled, "--strategy", "tp-sp"], "E0707", "--strategy tp-sp differs from the compiled plan's"),
        case(&["run", &compiled, "--precision", "bf16"], "E0780", "runs in the dtype it was compiled with"),
        case(&["explain", &compiled, "--mesh", "tp=2"], "E0702", "is a compiled directory"),
    ];
    for case in &cases {
        check(case);
    }
    let error = json_error(&["run", &path_str(&missing)]);
    assert_eq!(error["code"], "E0522");
    assert!(error["location"]["file"].as_str().is_some_and(|file| file.ends_with("rank1.program")), "{error}");
}

#[test]
fn weights_and_tokens() {
    let dir = tempdir("errors-weights");
    let garbage = write(&dir, "model.safetensors", "this is not a safetensors file");
    let empty_dir = dir.join("empty");
    std::fs::create_dir_all(&empty_dir).expect("mkdir");
    let ragged = write(&dir, "ragged.json", "[[1, 2, 3], [4, 5]]");
    let negative = write(&dir, "negative.json", "[[1, -2]]");
    let past_vocabulary = write(&dir, "past-vocabulary.json", "[[1, 2, 3, 300]]");
    let tokens = write(&dir, "tokens.json", "[[1, 2, 3, 4]]");
    let missing = path_str(&dir.join("absent.safetensors"));
    let cases = [
        case(
            &["run", "tiny", "--batch", "1", "--seq", "4", "--weights", &garbage],
            "E0612",
            "cannot read weights file",
        ),
        case(&["run", "tiny", "--batch", "1", "--seq", "4", "--weights", &missing], "E0610", "does not exist"),
        case(
            &["run", "tiny", "--batch", "1", "--seq", "4", "--weights", &path_str(&empty_dir)],
            "E0611",
            "holds neither",
        ),
        case(&["run", "tiny", "--tokens", &ragged], "E0705", "sequence 1 has 2 tokens"),
        case(&["run", "tiny", "--tokens", &negative], "E0705", "is not a valid id"),
        // Caught before the run, not by rank 0's embedding kernel (E0601, "check the program").
        case(&["run", "tiny", "--tokens", &past_vocabulary], "E0755", "token [0][3] is 300, not an id below"),
        case(&["run", "tiny", "--tokens", &garbage], "E0705", "expected a JSON array of arrays of token ids"),
        case(
            &["run", "tiny", "--tokens", &tokens, "--seq", "8"],
            "E0706",
            "the tokens file holds 1 sequences of 4 tokens",
        ),
    ];
    for case in &cases {
        check(case);
    }
    let error = json_error(&["run", "tiny", "--batch", "1", "--seq", "4", "--weights", &garbage]);
    assert_eq!(error["code"], "E0612");
    assert_eq!(error["location"]["file"], garbage.as_str());
    assert!(error["causes"].as_array().is_some_and(|causes| !causes.is_empty()), "{error}");
}

/// A checkpoint of the tiny model after one training step, shared by the cases that damage copies.
fn saved_tiny() -> &'static Path {
    // A static is never dropped: this directory (one a run of this binary) stays behind.
    static DIR: OnceLock<(TempDir, PathBuf)> = OnceLock::new();
    &DIR.get_or_init(|| {
        let scratch = tempdir("errors-checkpoint");
        let dir = scratch.join("saved");
        let output =
            pleat(&["run", "tiny", "--train", "--batch", "2", "--seq", "8", "--steps", "1", "--save", &path_str(&dir)]);
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        (scratch, dir)
    })
    .1
}

/// A copy of the saved checkpoint in `name`, for a case to damage.
fn saved_copy(name: &str) -> TempDir {
    let copy = tempdir(&format!("errors-ckpt-{name}"));
    for entry in std::fs::read_dir(saved_tiny()).expect("checkpoint dir") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), copy.join(entry.file_name())).expect("copy");
    }
    copy
}

#[test]
fn training_flags() {
    let dir = tempdir("errors-training");
    let bad_data = write(&dir, "bad.txt", "1, 2, 300");
    let binary_data = dir.join("binary.txt");
    std::fs::write(&binary_data, b"1 2 \xfe 3").expect("write");
    let binary_data = path_str(&binary_data);
    let empty_data = write(&dir, "empty.txt", " ,\n");
    // A terminal's escape and a 5 MB word were echoed whole, raw.
    let escape_data = write(&dir, "escape.txt", "1 2 \u{1b}[31m 3");
    let long_data = write(&dir, "long.txt", &"9".repeat(5_000_000));
    let tokens = write(&dir, "tokens.json", "[[1, 2, 3, 4]]");
    let compiled = path_str(compiled_tiny());
    let compiled_training = path_str(&dir.join("training"));
    stdout_of(&[
        "compile",
        "tiny",
        "--train",
        "--mesh",
        "dp=2",
        "--micro-batches",
        "2",
        "--batch",
        "4",
        "--seq",
        "8",
        "--out",
        &compiled_training,
    ]);
    let unwritten = path_str(&dir.join("unwritten"));
    let cases = [
        case(&["run", "tiny", "--train", "--mesh", "tp=2", "--strategy", "tp-sp-or-tsp"], "E0718", "folds inference"),
        case(&["run", "tiny", "--train", "--mesh", "tp=2", "--zero", "1"], "E0719", "--zero 1 splits state"),
        case(
            &["run", "tiny", "--train", "--batch", "4", "--micro-batches", "3"],
            "E0724",
            "--batch 4 does not split into --micro-batches 3",
        ),
        case(
            &["run", "tiny", "--train", "--mesh", "pp=2,dp=2", "--batch", "8", "--micro-batches", "8"],
            "E0725",
            "a micro-batch holds 1 sequences (--batch 8 over --micro-batches 8), which do not split over dp=2; \
             use --micro-batches in [1, 2, 4]",
        ),
        case(
            &["run", "tiny", "--train", "--mesh", "dp=2", "--batch", "3", "--micro-batches", "3"],
            "E0725",
            "nor does the whole batch; use a --batch that is a multiple of 6",
        ),
        case(&["run", "tiny", "--train", "--data", &bad_data], "E0726", "token 2 is \"300\""),
        case(&["run", "tiny", "--train", "--data", &binary_data], "E0726", "token 2 is \"\u{fffd}\""),
        case(&["run", "tiny", "--train", "--data", &escape_data], "E0726", "token 2 is \"\\u{1b}[31m\""),
        case(
            &["run", "tiny", "--train", "--data", &long_data],
            "E0726",
            &format!("token 0 is \"{}\", not", "9".repeat(40)),
        ),
        // (It was read until the kernel killed pleat.)
        case(&["run", "tiny", "--train", "--data", "/dev/zero"], "E0759", "more than 268435456 bytes"),
        case(&["run", "tiny", "--train", "--data", &empty_data], "E0727", "no token ids"),
        case(&["run", &compiled, "--train"], "E0728", "holds a forward pass (compiled without --train)"),
        case(&["run", &compiled_training], "E0792", "holds a training step (compiled with --train)"),
        case(&["launch", &compiled_training], "E0792", "it runs with --train"),
        case(
            &["run", &compiled_training, "--train", "--micro-batches", "1"],
            "E0793",
            "--micro-batches 1 differs from",
        ),
        case(&["compile", "tiny", "--train", "--emit", "exe", "--out", &unwritten], "E0794", "forward executables"),
        case(&["run", "tiny", "--train", "--tokens", &tokens], "E0729", "not --tokens"),
        case(&["run", "tiny", "--train", "--logits-out", "l.bin"], "E0730", "--logits-out applies to inference"),
        case(&["plan", "tiny", "--virtual-stages", "2"], "E0732", "--virtual-stages 2 needs a pp axis"),
        // plan costs only the interleaved schedules run builds.
        case(
            &["plan", "tiny", "--mesh", "pp=2", "--chunks", "2", "--micro-batches", "4"],
            "E0791",
            "tiny has 2 layers",
        ),
        case(
            &["plan", "llama3-8b", "--mesh", "pp=4", "--chunks", "2", "--micro-batches", "6"],
            "E0222",
            "6 is not a multiple",
        ),
        // Pipeline flags on a mesh without pp changed nothing; they are refused as --zero is
        // without dp.
        case(
            &["run", "tiny", "--train", "--mesh", "dp=2", "--micro-batches", "2", "--chunks", "3"],
            "E0753",
            "--chunks 3",
        ),
        case(
            &["run", "tiny", "--train", "--mesh", "dp=2", "--schedule", "interleaved"],
            "E0753",
            "--schedule interleaved",
        ),
        case(&["run", "tiny", "--train", "--pp-layers", "1,1"], "E0753", "--pp-layers 1,1 applies to pipeline stages"),
        case(&["bench", "comm", "--sizes", "KiB"], "E0737", "expected a number then a unit"),
        case(&["bench", "comm", "--sizes", "99999999999999GiB"], "E0738", "is too large"),
    ];
    for case in &cases {
        check(case);
    }
    let error = json_error(&["run", "tiny", "--train", "--data", &bad_data]);
    assert_eq!(error["code"], "E0726");
    assert_eq!(error["location"]["file"], bad_data.as_str());
    let error = json_error(&["run", "tiny", "--train", "--mesh", "tp=2", "--zero", "1"]);
    assert_eq!(error["location"]["flag"], "--zero");
}

#[test]
fn model_arguments() {
    let dir = tempdir("errors-model-args");
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).expect("mkdir");
    let cases = [
        case(&["plan", &path_str(&empty)], "E0733", "is a directory without config.json or plan.json"),
        case(&["plan", "no-such-model"], "E0734", "MODEL `no-such-model` is neither a preset"),
        case(&["run", "no-such-model", "--train"], "E0734", "is neither a preset"),
    ];
    for case in &cases {
        check(case);
    }
}

#[test]
fn training_checkpoints() {
    let saved = path_str(saved_tiny());
    let resume = |dir: &str| -> Vec<String> {
        ["run", "tiny", "--train", "--batch", "2", "--seq", "8", "--steps", "1", "--resume", dir]
            .iter()
            .map(|arg| arg.to_string())
            .collect()
    };
    let tampered = saved_copy("tampered");
    let weights = std::fs::read_dir(&tampered)
        .expect("checkpoint")
        .map(|entry| entry.expect("entry").path())
        .find(|path| path.extension().is_some_and(|extension| extension == "safetensors"))
        .expect("a block file");
    let mut bytes = std::fs::read(&weights).expect("read");
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&weights, bytes).expect("write");
    let version = saved_copy("version");
    let index_path = version.join("index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).expect("index.json")).expect("json");
    index["format_version"] = 999.into();
    std::fs::write(&index_path, index.to_string()).expect("write");
    let garbled = saved_copy("garbled");
    std::fs::write(garbled.join("index.json"), "{ not json").expect("write");
    let with = |dir: &Path, extra: &[&str]| -> Vec<String> {
        let mut args = resume(&path_str(dir));
        args.extend(extra.iter().map(|arg| arg.to_string()));
        args
    };
    let cases = [
        Case { args: with(&tampered, &[]), code: "E0541", says: "was changed after it was written".into() },
        Case { args: with(&version, &[]), code: "E0540", says: "checkpoint format 999 is not".into() },
        Case { args: with(&garbled, &[]), code: "E0543", says: "is not a pleat checkpoint index".into() },
        Case {
            args: with(saved_tiny(), &["--weights", &saved]),
            code: "E0731",
            says: "--resume reads the checkpoint's weights".into(),
        },
        Case { args: resume(".."), code: "E0735", says: ".. names no file or directory".into() },
    ];
    for case in &cases {
        check(case);
    }
    let args: Vec<&str> = cases[0].args.iter().map(String::as_str).collect();
    let error = json_error(&args);
    assert_eq!(error["code"], "E0541");
    assert_eq!(error["location"]["file"], path_str(&tampered).as_str());
}

#[test]
fn output_paths_are_checked_before_the_work() {
    // Each was found only once the run, the compile or the measurement was done (a long training
    // run lost at its first save), as an I/O error.
    let dir = tempdir("errors-outputs");
    let file = write(&dir, "file.txt", "keep me");
    let in_file = format!("{file}/out");
    let directory = path_str(&dir);
    let nowhere = path_str(&dir.join("missing").join("out.json"));
    let cases = [
        case(&["run", "tiny", "--seq", "8", "--trace", &directory], "E0750", "--trace"),
        case(&["run", "tiny", "--seq", "8", "--logits-out", &nowhere], "E0750", "/missing does not exist"),
        case(&["run", "tiny", "--train", "--steps", "500", "--save", &in_file], "E0750", "file.txt is not a directory"),
        case(&["compile", "tiny", "--mesh", "tp=2", "--out", &in_file], "E0750", "--out"),
        case(&["trace", "tiny", "--mesh", "tp=2", "--out", &directory], "E0750", "it is a directory"),
        case(&["search", "tiny", "--gpus", "8", "--emit-plan", &directory], "E0750", "--emit-plan"),
        case(&["bench", "calibrate", "--quick", "--out", &directory], "E0750", "it is a directory"),
        case(
            &["bench", "overlap", "tiny", "--mesh", "tp=2", "--emulate-link", "1,1", "--traces", &file],
            "E0750",
            "file.txt is not a directory",
        ),
    ];
    for case in &cases {
        check(case);
    }
    assert_eq!(std::fs::read_to_string(&file).expect("the file"), "keep me");
}

/// The one-rank checkpoint's weights as a Hugging Face file in `dir`, with element `index` of
/// `model.norm.weight` set to `value`.
fn tiny_weights_with(dir: &Path, value: f32, index: usize) -> String {
    let block_file = saved_tiny().join("rank0.safetensors");
    let bytes = std::fs::read(&block_file).expect("block file");
    let header_len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + header_len]).expect("header");
    let data = &bytes[8 + header_len..];
    let mut tensors = Vec::new();
    for (block, info) in &header {
        let Some((name, _)) = block.split_once('@') else { continue };
        if name.ends_with(".exp_avg") || name.ends_with(".exp_avg_sq") {
            continue;
        }
        let shape: Vec<u64> =
            info["shape"].as_array().expect("shape").iter().map(|dim| dim.as_u64().unwrap()).collect();
        let offsets = info["data_offsets"].as_array().expect("offsets");
        let (start, end) = (offsets[0].as_u64().unwrap() as usize, offsets[1].as_u64().unwrap() as usize);
        let mut values: Vec<f32> =
            data[start..end].chunks_exact(4).map(|quad| f32::from_le_bytes(quad.try_into().unwrap())).collect();
        if name == "model.norm.weight" {
            values[index] = value;
        }
        tensors.push((name.to_string(), shape, values));
    }
    let file = dir.join(format!("model-{value}.safetensors"));
    pleat_runtime::weights::write_safetensors(&file, &tensors).expect("write");
    path_str(&file)
}

#[test]
fn a_weight_that_is_not_finite_is_refused_with_its_tensor() {
    // The run used to print NaN logits, or fail its --check, or blame --lr for a diverged step.
    let dir = tempdir("errors-not-finite");
    let file = tiny_weights_with(&dir, f32::NAN, 5);
    for mesh in ["dp=1", "tp=2"] {
        check(&case(
            &["run", "tiny", "--mesh", mesh, "--batch", "2", "--seq", "8", "--weights", &file],
            "E0624",
            "tensor `model.norm.weight` in",
        ));
    }
    let error = json_error(&["run", "tiny", "--batch", "2", "--seq", "8", "--weights", &file]);
    assert!(error["message"].as_str().is_some_and(|message| message.contains("holds NaN at [5]")), "{error}");
    assert_eq!(error["location"]["tensor"], "model.norm.weight");
}

#[test]
fn weights_that_overflow_are_not_called_a_pleat_bug_or_the_learning_rates() {
    // A finite weight near f32's largest overflows the forward: --check's reference overflows too
    // (it said "a pleat bug"), and the first step's gradient norm is infinite before any update
    // (it said "lower --lr").
    let dir = tempdir("errors-overflow");
    let file = tiny_weights_with(&dir, f32::MAX, 0);
    let sizes = ["--batch", "2", "--seq", "8", "--weights", &file];
    let forward = [&["run", "tiny", "--mesh", "tp=2", "--check"][..], &sizes].concat();
    check(&case(&forward, "E0751", "so --check cannot judge the run"));
    let training = [&["run", "tiny", "--mesh", "dp=2", "--train", "--steps", "2"][..], &sizes].concat();
    check(&case(&training, "E0752", "step 1, this run's first"));
    // Short of overflow, logits near 1e38 are held to 1e-5 of the largest (they were 1.3e31
    // apart, f32's rounding of them, and the absolute 1e-4 called that a pleat bug).
    let large = tiny_weights_with(&dir, 1e38, 0);
    let output =
        cli::pleat(&["run", "tiny", "--mesh", "tp=2", "--check", "--batch", "2", "--seq", "8", "--weights", &large]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success() && stdout.contains("): ok"), "{stdout}{}", String::from_utf8_lossy(&output.stderr));
}

#[test]
fn text_ir_errors_have_a_code_a_place_and_help() {
    use miette::Diagnostic;
    let header = "; module m mesh=tp=2\n";
    let cases = [
        (format!("{header}v0: f32[seq=4] = rms_nrom(v0, v0)\n"), 2, 18, "rms_nrom"),
        (format!("{header}v0: f32[seq=4] = tokens()\nv0: f32[seq=4] = tokens()\n"), 3, 1, "v0"),
        (format!("{header}v0: q32[seq=4] = tokens()\n"), 2, 5, "q32"),
    ];
    for (text, line, column, quoted) in cases {
        let error = pleat_ir::text::parse_module(&text).expect_err("the text is invalid");
        assert_eq!(error.code().map(|code| code.to_string()).as_deref(), Some("E0301"), "{error}");
        assert!(error.help().is_some(), "{error}");
        assert_eq!((error.line, error.column), (line, column), "{error}");
        let label = error.labels().into_iter().flatten().next().expect("a label");
        assert_eq!(&text[label.offset()..label.offset() + label.len()], quoted, "{error}");
    }
}

/// Every code the sources give, in the order found, from `#[diagnostic(code(E0xxx), ...)]` and the
/// hand-written `"E0xxx"` codes of the parser and the report.
fn codes_in_sources() -> Vec<(String, PathBuf)> {
    fn walk(dir: &Path, found: &mut Vec<(String, PathBuf)>) {
        for entry in std::fs::read_dir(dir).expect("a source directory") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                walk(&path, found);
            } else if path.extension().is_some_and(|extension| extension == "rs") {
                let text = std::fs::read_to_string(&path).expect("source");
                for marker in ["code(E", "Box::new(\"E", "&str = \"E"] {
                    for (start, _) in text.match_indices(marker) {
                        let code = &text[start + marker.len() - 1..];
                        let code: String = code.chars().take(5).collect();
                        found.push((code, path.clone()));
                    }
                }
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = Vec::new();
    for dir in ["src", "ir/src", "passes/src", "backend/src", "runtime/src", "rt/src"] {
        walk(&root.join(dir), &mut found);
    }
    found
}

#[test]
fn every_code_is_given_once_and_documented() {
    let docs = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/errors.md")).expect("docs");
    let documented: Vec<&str> =
        docs.lines().filter_map(|line| line.strip_prefix("| E")).map(|rest| &rest[..4]).collect();
    let mut unique = documented.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), documented.len(), "docs/errors.md lists a code twice");
    let found = codes_in_sources();
    assert!(found.len() > 100, "only {} codes found in the sources", found.len());
    let mut seen = std::collections::HashMap::new();
    for (code, path) in &found {
        assert!(code.len() == 5 && code[1..].chars().all(|c| c.is_ascii_digit()), "{code} in {}", path.display());
        assert!(documented.contains(&&code[1..]), "{code} ({}) is not in docs/errors.md", path.display());
        if let Some(first) = seen.insert(code.clone(), path.clone()) {
            panic!("{code} is given twice: {} and {}", first.display(), path.display());
        }
    }
    for code in &documented {
        assert!(seen.contains_key(&format!("E{code}")), "docs/errors.md lists E{code}, which no error gives");
    }
    // A retired code is listed apart, and no error gives it again.
    let retired: Vec<&str> = docs.lines().filter_map(|line| line.strip_prefix("- E")).map(|rest| &rest[..4]).collect();
    assert!(retired.contains(&"0603"), "{retired:?}");
    for code in &retired {
        assert!(!documented.contains(code) && !seen.contains_key(&format!("E{code}")), "E{code} is retired");
    }
}

//! pleat-rt: pleat's runtime as a static library, `libpleat_rt.a`, which `pleat compile --emit exe`
//! links with each rank's object into the executable `DIR/rank<i>`.
//!
//! The object holds the rank's generated code: its kernels, its entry function `pleat_rank_main`
//! (which calls the runtime's `pleat_rt_*` C ABI, `pleat_runtime::capi`) and a `main` that hands
//! both to [`pleat_rt_exe_main`]. That function reads the rank's program from the compiled
//! directory, joins the MPI job (mpirun starts one process a rank), runs the program through the
//! entry function and writes the rank's outcome for `pleat run DIR` to collect
//! (`pleat_runtime::outcome_file`).
//!
//! Guarantees: a rank executable runs only the program it was generated for (its fingerprint must
//! equal the program file's) as the MPI rank it was generated for, in a job of the program's world
//! size; a failure on any rank ends the whole job with the reason on standard error, never a hang.

mod args;
mod error;
mod rank;

use std::ffi::{c_char, c_int, CStr};

use pleat_runtime::native::{EntryFunction, FingerprintFunction};

pub use args::ExeArgs;
pub use error::ExeError;
pub use rank::run_rank;

/// A rank executable's `main`: runs rank `rank` (whose generated entry function is `entry` and
/// whose program's fingerprint `fingerprint` returns) with the command line `argc`, `argv`;
/// returns the process's exit status (0, 1 when the run failed, 2 for a bad command line).
///
/// # Safety
/// `argv` holds `argc` valid C strings; `entry` and `fingerprint` are the functions
/// `pleat compile --emit exe` generated into the same executable.
#[no_mangle]
pub unsafe extern "C" fn pleat_rt_exe_main(
    argc: c_int,
    argv: *const *const c_char,
    rank: u32,
    entry: EntryFunction,
    fingerprint: FingerprintFunction,
) -> c_int {
    let words: Vec<String> = (0..argc.max(0) as usize)
        // SAFETY: the caller passes `argc` valid C strings in `argv`.
        .map(|i| unsafe { CStr::from_ptr(*argv.add(i)) }.to_string_lossy().into_owned())
        .collect();
    if words.iter().skip(1).any(|word| word == "--help" || word == "-h") {
        return print_usage();
    }
    // SAFETY: `fingerprint` is the generated function, which takes nothing and returns a constant.
    let fingerprint = unsafe { fingerprint() };
    let result = std::panic::catch_unwind(|| {
        let args = ExeArgs::parse(&words)?;
        run_rank(&args, rank, entry, fingerprint)
    });
    match result {
        Ok(Ok(())) => 0,
        Ok(Err(error)) => report(rank, &error),
        Err(_) => 1,
    }
}

/// Prints how to call a rank executable (`--help`); exit status 0.
#[allow(clippy::print_stdout, reason = "this is the rank executable's main: --help answers on standard output")]
fn print_usage() -> c_int {
    println!("{}", args::USAGE);
    0
}

/// `error` as pleat reports errors: `error[E0xxx]: rank<i>: message`, then a `help:` line.
fn report_text(rank: u32, error: &ExeError) -> String {
    use miette::Diagnostic;
    let code = error.code().map_or_else(|| "E0700".to_string(), |code| code.to_string());
    let mut text = format!("error[{code}]: rank{rank}: {error}\n");
    if let Some(help) = error.help() {
        text.push_str(&format!("  help: {help}\n"));
    }
    text
}

/// Prints why this rank ends the job, before `MPI_Abort` does.
#[allow(clippy::print_stderr, reason = "this is the rank executable's main: standard error is its report")]
fn report_abort(rank: u32, error: &ExeError) {
    eprint!("{}", report_text(rank, error));
}

/// Prints `error` as the process's last words; the exit status it deserves.
#[allow(clippy::print_stderr, reason = "this is the rank executable's main: standard error is its report")]
fn report(rank: u32, error: &ExeError) -> c_int {
    eprint!("{}", report_text(rank, error));
    match error {
        ExeError::Usage(_) => {
            eprintln!("\n{}", args::USAGE);
            2
        }
        _ => 1,
    }
}

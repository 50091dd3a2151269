//! Build script of the `pleat` package: the executables it links (the `pleat` binary, its tests and
//! benchmarks) export the runtime's C ABI (`pleat_rt_*`, `pleat_runtime::capi`) to the rank
//! libraries they load, whose entry functions call it (`pleat compile --emit so`).

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        // GNU ld (2.35 and later) and lld take a glob; the functions stay linked because
        // `capi::execute_entry` references them all.
        println!("cargo:rustc-link-arg=-Wl,--export-dynamic-symbol=pleat_rt_*");
    }
}

//! The CPU names `--target-cpu` accepts. LLVM does not reject an unknown CPU: it prints "not a
//! recognized processor", falls back to a generic 32-bit subtarget and then aborts the process
//! ("64-bit code requested on a subtarget that doesn't support it") halfway through emitting.
//! LLVM-C has no query for the names, so the x86-64 ones are listed here.

use inkwell::targets::{TargetMachine, TargetTriple};

use super::LlvmError;

/// LLVM 19's x86 processors that can run 64-bit code: `llc -mtriple=x86_64-unknown-linux-gnu
/// -mcpu=help`, keeping each name with which `llc` compiles a 64-bit function (the 32-bit-only
/// ones, `i686`, `pentium4`, `athlon-xp` and the like, abort as above).
pub const X86_64_CPUS: [&str; 91] = [
    "alderlake",
    "amdfam10",
    "arrowlake",
    "arrowlake-s",
    "arrowlake_s",
    "athlon-fx",
    "athlon64",
    "athlon64-sse3",
    "atom",
    "atom_sse4_2",
    "atom_sse4_2_movbe",
    "barcelona",
    "bdver1",
    "bdver2",
    "bdver3",
    "bdver4",
    "bonnell",
    "broadwell",
    "btver1",
    "btver2",
    "cannonlake",
    "cascadelake",
    "clearwaterforest",
    "cooperlake",
    "core-avx-i",
    "core-avx2",
    "core2",
    "core_2_duo_sse4_1",
    "core_2_duo_ssse3",
    "core_2nd_gen_avx",
    "core_3rd_gen_avx",
    "core_4th_gen_avx",
    "core_4th_gen_avx_tsx",
    "core_5th_gen_avx",
    "core_5th_gen_avx_tsx",
    "core_aes_pclmulqdq",
    "core_i7_sse4_2",
    "corei7",
    "corei7-avx",
    "emeraldrapids",
    "generic",
    "goldmont",
    "goldmont-plus",
    "goldmont_plus",
    "gracemont",
    "grandridge",
    "graniterapids",
    "graniterapids-d",
    "graniterapids_d",
    "haswell",
    "icelake-client",
    "icelake-server",
    "icelake_client",
    "icelake_server",
    "ivybridge",
    "k8",
    "k8-sse3",
    "knl",
    "knm",
    "lunarlake",
    "meteorlake",
    "mic_avx512",
    "nehalem",
    "nocona",
    "opteron",
    "opteron-sse3",
    "pantherlake",
    "penryn",
    "raptorlake",
    "rocketlake",
    "sandybridge",
    "sapphirerapids",
    "sierraforest",
    "silvermont",
    "skx",
    "skylake",
    "skylake-avx512",
    "skylake_avx512",
    "slm",
    "tigerlake",
    "tremont",
    "westmere",
    "x86-64",
    "x86-64-v2",
    "x86-64-v3",
    "x86-64-v4",
    "znver1",
    "znver2",
    "znver3",
    "znver4",
    "znver5",
];

/// Whether LLVM can generate code for `cpu` on `triple`: on x86-64 one of [`X86_64_CPUS`]; on
/// other targets LLVM's own check is all there is.
pub fn check_target_cpu(triple: &TargetTriple, cpu: &str) -> Result<(), LlvmError> {
    let triple_text = triple.as_str().to_string_lossy().into_owned();
    if !triple_text.starts_with("x86_64") || X86_64_CPUS.contains(&cpu) {
        return Ok(());
    }
    Err(LlvmError::Target {
        triple: triple_text,
        cpu: cpu.to_string(),
        message: "not an x86-64 processor LLVM 19 knows; use x86-64, x86-64-v2, x86-64-v3 or x86-64-v4, or a \
                  processor such as skylake, icelake-server or znver4 (`llc -mtriple=x86_64 -mcpu=help` lists them)"
            .to_string(),
    })
}

/// Whether LLVM can generate code for `cpu` on this machine's target, the one host code is
/// generated for (see `check_target_cpu`).
pub fn check_host_target_cpu(cpu: &str) -> Result<(), LlvmError> {
    check_target_cpu(&TargetMachine::get_default_triple(), cpu)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn x86_64_takes_llvms_64_bit_processors_and_refuses_the_rest() {
        let triple = TargetTriple::create("x86_64-unknown-linux-gnu");
        for cpu in ["x86-64-v3", "skylake", "znver4", "generic"] {
            assert!(check_target_cpu(&triple, cpu).is_ok(), "{cpu}");
        }
        for cpu in ["bogus", "i686", "pentium4", "Skylake"] {
            let err = check_target_cpu(&triple, cpu).expect_err(cpu).to_string();
            assert!(err.contains(cpu) && err.contains("x86-64-v3"), "{err}");
        }
        // Sorted and unique, so a name is easy to find and none is listed twice.
        assert!(X86_64_CPUS.windows(2).all(|pair| pair[0] < pair[1]));
        // Other targets are LLVM's to check.
        assert!(check_target_cpu(&TargetTriple::create("aarch64-unknown-linux-gnu"), "neoverse-v2").is_ok());
    }
}

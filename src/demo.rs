//! `pleat demo`: the main job on the built-in tiny model, end to end.

use anyhow::{bail, Result};
use pleat_ir::model::preset::preset;
use pleat_ir::{Mesh, Op};
use pleat_passes::Dump;
use pleat_runtime::weights::SeededWeights;

use crate::compile::{ModelOnMesh, Strategy};
use crate::inputs::random_tokens;
use crate::reference::check_logits;
use crate::run::{comm_bytes_mean, human_bytes, link_options, run_programs};

/// Runs the demo and prints its summary.
pub fn demo() -> Result<()> {
    let config = preset("tiny")?;
    let (batch, seq) = (8, 64);
    let mesh = Mesh::parse("tp=4")?;
    println!(
        "pleat demo: {} ({} layers, hidden {}, {} heads / {} kv heads, ffn {}, vocab {}), batch {batch} x seq {seq}",
        config.name,
        config.num_layers,
        config.hidden_size,
        config.num_heads,
        config.num_kv_heads,
        config.intermediate_size,
        config.vocab_size
    );
    // Compiled and scheduled for overlap as `pleat run` compiles the preset.
    let target = ModelOnMesh {
        model: config.name.clone(),
        mesh: mesh.to_string(),
        strategy: Strategy::Auto,
        seq,
        batch,
        no_overlap: false,
        comm_streams: 2,
    };
    let compiled = target.compile(&config, Dump::Nothing, crate::compile::Kernels::Interpreted)?;
    let graph = &compiled.sharded.graph;
    let count = |want: fn(&Op) -> bool| graph.order().iter().filter(|&&node| want(&graph.node(node).op)).count();
    println!(
        "compiled for Megatron tensor parallelism, {mesh}: {} rank programs, {} all-reduces ({} a layer + the embedding's), {} all-gather (the vocab-parallel logits)",
        compiled.programs.len(),
        count(|op| matches!(op, Op::AllReduce { .. })),
        2,
        count(|op| matches!(op, Op::AllGather { .. }))
    );
    let tokens = random_tokens(batch, seq, config.vocab_size, 0)?;
    let weights = SeededWeights::new(0);
    let (_, logits, outcomes) = run_programs(&compiled.programs, &tokens, &weights, &link_options(120, None))?;
    let peak = outcomes.iter().map(|outcome| outcome.peak_bytes).max().unwrap_or(0);
    let sent: Vec<String> = comm_bytes_mean(&outcomes)
        .into_iter()
        .filter(|&(_, bytes)| bytes > 0)
        .map(|(name, bytes)| format!("{name} {}", human_bytes(bytes)))
        .collect();
    println!("ran on {} threads: peak {} a rank; sent a rank: {}", outcomes.len(), human_bytes(peak), sent.join(", "));
    // The demo's model has no mixture of experts, so every token is judged.
    let (check, tolerance) = check_logits(&config, &tokens, &weights, &compiled.programs, &logits, false)?;
    let err = check.max_abs_err.unwrap_or(f32::NAN);
    let verdict = if err <= tolerance { "ok" } else { "FAILED" };
    println!("checked against the reference interpreter: max |logits - reference| = {err:.3e} (tolerance {tolerance:e}): {verdict}");
    if err.is_nan() || err > tolerance {
        bail!(crate::usage::UsageError::DemoMismatch { err });
    }
    Ok(())
}

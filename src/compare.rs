//! `pleat compare`: every one- and two-axis layout of D ranks side by side, one block a sequence
//! length, sorted by peak memory a rank.

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use pleat_ir::AxisName;
use pleat_passes::cost::{estimate, Estimate, Layout};
use serde_json::json;

use crate::plan::{gb, WorkloadArgs};

/// Output formats of `compare`.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum CompareFormat {
    Table,
    Json,
    Csv,
}

/// Arguments of `pleat compare`.
#[derive(Args)]
pub struct CompareArgs {
    #[command(flatten)]
    pub common: WorkloadArgs,
    /// Ranks a model replica.
    #[arg(long)]
    pub ranks: u64,
    /// Sequence lengths, comma-separated: one block each.
    #[arg(long, value_delimiter = ',', default_value = "4096,16384,131072", value_parser = crate::number_flags::count::<u64>)]
    pub seq: Vec<u64>,
    /// Output format (`csv` is plot-ready: one row a layout and length).
    #[arg(long, value_enum, default_value_t = CompareFormat::Table)]
    pub format: CompareFormat,
}

/// The layouts of `ranks` ranks: dp, tp, tp with Megatron SP, cp, tsp, and tp x sp, tp x cp (with
/// and without SP) for every split of `ranks` into two factors above 1 (one rank: the one plan).
pub fn layouts(ranks: u64) -> Vec<Layout> {
    // One rank has one layout: every axis of degree 1 is the same plan.
    if ranks == 1 {
        return vec![Layout::new(&[(AxisName::Dp, 1)], false)];
    }
    let mut layouts = vec![
        Layout::new(&[(AxisName::Dp, ranks)], false),
        Layout::new(&[(AxisName::Tp, ranks)], false),
        Layout::new(&[(AxisName::Tp, ranks)], true),
        Layout::new(&[(AxisName::Cp, ranks)], false),
        Layout::new(&[(AxisName::Tsp, ranks)], false),
    ];
    for tp in pleat_ir::spec::divisors(ranks).into_iter().filter(|&tp| tp > 1 && tp < ranks) {
        let other = ranks / tp;
        // The sequence axis outside, tp inside a node: the usual placement.
        layouts.push(Layout::new(&[(AxisName::Sp, other), (AxisName::Tp, tp)], false));
        layouts.push(Layout::new(&[(AxisName::Cp, other), (AxisName::Tp, tp)], false));
        // Megatron's context parallelism beside SP: tp splits each cp rank's tokens.
        layouts.push(Layout::new(&[(AxisName::Cp, other), (AxisName::Tp, tp)], true));
    }
    layouts
}

/// The layouts a model cannot take, each with the reason.
type Skipped = Vec<(String, String)>;

/// One block: the estimates of every layout at `seq`, sorted by peak memory, and the layouts the
/// model cannot take with the reason.
pub fn block(args: &CompareArgs, seq: u64) -> Result<(Vec<Estimate>, Skipped)> {
    let model = args.common.model_shape()?;
    let hw = args.common.hardware()?;
    let workload = args.common.workload(seq);
    let mut rows = Vec::new();
    let mut skipped = Vec::new();
    for layout in layouts(args.ranks) {
        match estimate(&model, &layout, &workload, &hw) {
            Ok(result) => rows.push(result),
            Err(err) => skipped.push((layout.label(), err.to_string())),
        }
    }
    rows.sort_by(|a, b| a.memory.peak_bytes.total_cmp(&b.memory.peak_bytes));
    Ok((rows, skipped))
}

/// Runs `pleat compare`.
pub fn compare(args: &CompareArgs) -> Result<()> {
    if args.ranks == 0 {
        bail!(crate::usage::UsageError::ZeroFlag { flag: "--ranks", what: "rank" });
    }
    let max = pleat_ir::Mesh::MAX_RANKS;
    if args.ranks > max {
        bail!(crate::usage::UsageError::TooManyRanks { flag: "--ranks", ranks: args.ranks, max });
    }
    if args.seq.is_empty() {
        bail!(crate::usage::UsageError::EmptySeqList);
    }
    let mut blocks = Vec::new();
    for &seq in &args.seq {
        blocks.push((seq, block(args, seq)?));
    }
    match args.format {
        CompareFormat::Table => {
            for (index, (seq, (rows, skipped))) in blocks.iter().enumerate() {
                if index > 0 {
                    println!();
                }
                print_block(args, *seq, rows, skipped);
            }
        }
        CompareFormat::Csv => {
            println!("seq,layout,compiles_today,peak_bytes,params_bytes,grads_bytes,optimizer_bytes,activations_bytes,transient_bytes,logits_bytes,comm_bytes_per_layer_fwd,comm_bytes_per_step,step_s,tokens_per_s,mfu");
            for (seq, (rows, _)) in &blocks {
                for row in rows {
                    let memory = &row.memory;
                    println!(
                        "{seq},{},{},{:.0},{:.0},{:.0},{:.0},{:.0},{:.0},{:.0},{:.0},{:.0},{:.6e},{:.6e},{:.6}",
                        row.layout,
                        row.compiles_today,
                        memory.peak_bytes,
                        memory.params_bytes,
                        memory.grads_bytes,
                        memory.optimizer_bytes,
                        memory.activations_bytes,
                        memory.transient_bytes,
                        memory.logits_bytes,
                        row.comm.bytes_per_layer_fwd,
                        row.comm.bytes_per_step,
                        row.time.step_s,
                        row.tokens_per_s,
                        row.mfu
                    );
                }
            }
        }
        CompareFormat::Json => {
            let value: Vec<_> = blocks
                .iter()
                .map(|(seq, (rows, skipped))| {
                    json!({
                        "seq": seq,
                        "rows": rows,
                        "skipped": skipped.iter().map(|(layout, reason)| json!({"layout": layout, "reason": reason})).collect::<Vec<_>>(),
                    })
                })
                .collect();
            crate::json_output::print(json!({"ranks": args.ranks, "blocks": value}))?;
        }
    }
    Ok(())
}

fn print_block(args: &CompareArgs, seq: u64, rows: &[Estimate], skipped: &[(String, String)]) {
    let hardware = rows.first().map_or(String::new(), |row| row.hardware.clone());
    println!("{} on {} ranks of {hardware}, seq {seq} x batch {}:", args.common.model, args.ranks, args.common.batch);
    println!(
        "  {:<14} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12} {:>12} {:>9} {:>12} {:>6}  compiles",
        "layout",
        "peak",
        "static",
        "activ.",
        "transient",
        "logits",
        "comm/layer",
        "comm/step",
        "step s",
        "tokens/s",
        "MFU"
    );
    for row in rows {
        let memory = &row.memory;
        println!(
            "  {:<14} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12} {:>12} {:>9.3} {:>12.0} {:>5.1}%  {}",
            row.layout,
            gb(memory.peak_bytes),
            gb(memory.params_bytes + memory.grads_bytes + memory.optimizer_bytes),
            gb(memory.activations_bytes),
            gb(memory.transient_bytes),
            gb(memory.logits_bytes),
            gb(row.comm.bytes_per_layer_fwd),
            gb(row.comm.bytes_per_step),
            row.time.step_s,
            row.tokens_per_s,
            100.0 * row.mfu,
            if row.compiles_today { "yes" } else { "model only" }
        );
    }
    for (layout, reason) in skipped {
        println!("  {layout:<14} n/a: {reason}");
    }
}

//! `pleat search`: the best plans for a model on a cluster, ranked by predicted step time, with the
//! reason the winner wins, and a plan file `pleat compile --plan` builds.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use pleat_passes::cost::Mode;
use pleat_passes::search::{describe_workload, search, why_first, Plan, SearchSpace, MODELLED_AXES};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::plan::{gb, hardware_of, model_shape_of};

/// Output formats of `search`.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum SearchFormat {
    Table,
    Json,
}

/// Arguments of `pleat search`.
#[derive(Args)]
pub struct SearchArgs {
    /// A preset name, a config.json, or a model directory.
    pub model: String,
    /// GPUs (ranks) in all.
    #[arg(long)]
    pub gpus: u64,
    /// GPUs a node (default: the hardware's).
    #[arg(long)]
    pub gpus_per_node: Option<u64>,
    /// Built-in hardware: h100-sxm, h200, a100-80gb, mi300x, cpu.
    #[arg(long, default_value = "h100-sxm")]
    pub hw: String,
    /// A hardware or cluster spec as TOML or JSON (device, intra- and inter-node links); overrides --hw.
    #[arg(long)]
    pub hw_file: Option<PathBuf>,
    /// Tokens a sequence.
    #[arg(long, default_value_t = 4096)]
    pub seq: u64,
    /// Sequences a step over all replicas (default: one a GPU).
    #[arg(long)]
    pub global_batch: Option<u64>,
    /// The most memory a GPU may use, GB (default: the device's).
    #[arg(long, value_parser = crate::number_flags::positive)]
    pub mem_cap: Option<f64>,
    /// Inference (one forward pass) instead of training.
    #[arg(long)]
    pub infer: bool,
    /// Plans shown.
    #[arg(long, default_value_t = 10, value_parser = crate::number_flags::count::<usize>)]
    pub top: usize,
    /// Output format.
    #[arg(long, value_enum, default_value_t = SearchFormat::Table)]
    pub format: SearchFormat,
    /// Say why the winner beats the runner-up, and compare the best plan of each single axis.
    #[arg(long)]
    pub explain: bool,
    /// Write the winning plan to this file, for `pleat compile --plan`.
    #[arg(long)]
    pub emit_plan: Option<PathBuf>,
    /// Also search the axes only the cost model knows today (sp, and pp for a forward pass): their
    /// plans are marked and cannot be compiled yet.
    #[arg(long)]
    pub all_axes: bool,
}

/// The version of a plan file.
pub const SEARCH_PLAN_VERSION: u32 = 1;

/// A plan file: what `pleat compile --plan` needs to build the plan, and what it was predicted to do.
#[derive(Serialize, Deserialize)]
pub struct PlanChoice {
    /// `SEARCH_PLAN_VERSION`.
    pub format_version: u32,
    /// The model it was searched for.
    pub model: String,
    /// The mesh, as `--mesh` takes it.
    pub mesh: String,
    /// The `--strategy`.
    pub strategy: String,
    /// Tokens a sequence.
    pub seq: u64,
    /// Sequences a micro-batch a replica.
    pub micro_batch: u64,
    /// Micro-batches a step.
    pub micro_batches: u64,
    /// Ways the batch is split: dp, times ep for a mixture of experts (ep splits the batch as dp
    /// does), so that `micro_batch · dp` is the batch `pleat compile --plan` builds.
    pub dp: u64,
    /// ZeRO stage.
    pub zero: u8,
    /// Recompute mode.
    pub recompute: String,
    /// Predicted seconds a step.
    pub predicted_step_s: f64,
    /// Predicted peak bytes a GPU.
    pub predicted_peak_bytes: f64,
}

impl PlanChoice {
    fn of(model: &str, plan: &Plan) -> PlanChoice {
        PlanChoice {
            format_version: SEARCH_PLAN_VERSION,
            model: model.to_string(),
            mesh: plan.mesh(),
            strategy: if plan.layout.sequence_parallel { "tp-sp" } else { "auto" }.to_string(),
            seq: plan.workload.seq,
            micro_batch: plan.workload.micro_batch,
            micro_batches: plan.workload.micro_batches,
            dp: plan.layout.batch_split(),
            zero: plan.workload.zero,
            recompute: plan.workload.recompute.as_str().to_string(),
            predicted_step_s: plan.estimate.time.step_s,
            predicted_peak_bytes: plan.estimate.memory.peak_bytes,
        }
    }

    /// Reads a plan file.
    pub fn read(path: &std::path::Path) -> Result<PlanChoice> {
        let text = crate::text_file::read_text(path).with_context(|| format!("cannot read {}", path.display()))?;
        let choice: PlanChoice = serde_json::from_str(&text).map_err(|error| crate::usage::UsageError::NotAPlan {
            path: path.to_path_buf(),
            what: "search plan",
            reason: error.to_string(),
        })?;
        if choice.format_version != SEARCH_PLAN_VERSION {
            anyhow::bail!(crate::usage::UsageError::SearchPlanVersion {
                path: path.to_path_buf(),
                found: choice.format_version,
                expected: SEARCH_PLAN_VERSION
            });
        }
        if let Some(reason) = choice.inconsistency() {
            anyhow::bail!(crate::usage::UsageError::NotAPlan { path: path.to_path_buf(), what: "search plan", reason });
        }
        Ok(choice)
    }

    /// What makes the plan one `pleat search` cannot have written (an edited field), if anything:
    /// each was compiled as given (a ZeRO stage of 7 trained as ZeRO-3), or failed later under
    /// another flag's name.
    fn inconsistency(&self) -> Option<String> {
        let mesh = match pleat_ir::Mesh::parse(&self.mesh) {
            Ok(mesh) => mesh,
            Err(error) => return Some(format!("its mesh {:?} does not parse: {error}", self.mesh)),
        };
        let batch_split = crate::pipeline::batch_ranks(&mesh);
        if self.zero > 3 {
            Some(format!("zero is {}; a ZeRO stage is 0 to 3", self.zero))
        } else if self.seq == 0 || self.micro_batch == 0 || self.micro_batches == 0 {
            Some(format!(
                "seq {}, micro_batch {} and micro_batches {} must each be 1 or more",
                self.seq, self.micro_batch, self.micro_batches
            ))
        } else if self.dp != batch_split {
            Some(format!("dp is {}, and its mesh {} splits the batch {batch_split} ways (dp × ep)", self.dp, self.mesh))
        } else {
            None
        }
    }
}

fn step_of(plan: &Plan) -> f64 {
    plan.estimate.time.step_s
}

fn plan_json(rank: usize, plan: &Plan) -> serde_json::Value {
    json!({
        "rank": rank,
        "layout": plan.estimate.layout,
        "compiles_today": plan.layout.compiles_today(plan.workload.mode),
        "mesh": plan.mesh(),
        "micro_batch": plan.workload.micro_batch,
        "micro_batches": plan.workload.micro_batches,
        "zero": plan.workload.zero,
        "recompute": plan.workload.recompute.as_str(),
        "peak_bytes": plan.estimate.memory.peak_bytes,
        "step_s": plan.estimate.time.step_s,
        "compute_s": plan.estimate.time.compute_s,
        "comm_s": plan.estimate.time.comm_s,
        "bubble_s": plan.estimate.time.bubble_s,
        "tokens_per_s_per_gpu": plan.estimate.tokens_per_s / plan.layout.world_size() as f64,
        "mfu": plan.estimate.mfu,
    })
}

/// Runs `pleat search`.
pub fn run_search(args: &SearchArgs) -> Result<()> {
    if let Some(path) = &args.emit_plan {
        crate::checkpoint::check_output_file(path, "--emit-plan")?;
    }
    let model = model_shape_of(&args.model)?;
    let mut hw = hardware_of(&args.hw, args.hw_file.as_deref())?;
    if let Some(per_node) = args.gpus_per_node {
        anyhow::ensure!(per_node > 0, crate::usage::UsageError::ZeroFlag { flag: "--gpus-per-node", what: "GPU" });
        hw.gpus_per_node = per_node;
    }
    let cap = args.mem_cap.map_or(hw.memory_bytes as f64, |gigabytes| gigabytes * 1e9);
    let mode = if args.infer { Mode::Infer } else { Mode::Train };
    let mut space = SearchSpace::new(args.gpus, args.seq, args.global_batch.unwrap_or(args.gpus), mode, cap);
    space.keep = args.top.max(1);
    if args.all_axes {
        space.axes = MODELLED_AXES.to_vec();
    }
    let outcome = search(&model, &hw, &space)?;
    let top: Vec<&Plan> = outcome.plans.iter().collect();
    let single_by_memory: Vec<&Plan> = outcome.single_axis.iter().map(|(least_memory, _)| least_memory).collect();
    let mut single_by_time: Vec<&Plan> = outcome.single_axis.iter().map(|(_, fastest)| fastest).collect();
    single_by_time.sort_by(|a, b| step_of(a).total_cmp(&step_of(b)));
    let why = (outcome.plans.len() > 1).then(|| why_first(&outcome.plans[0], &outcome.plans[1]));
    let why_single = (single_by_time.len() > 1).then(|| why_first(single_by_time[0], single_by_time[1]));
    // TSP against the best tensor-parallel plan (with or without Megatron SP): the paper's question.
    let with_axis = |axis| single_by_time.iter().copied().find(|plan| plan.layout.degree(axis) > 1);
    let why_tsp_tp = match (with_axis(pleat_ir::AxisName::Tp), with_axis(pleat_ir::AxisName::Tsp)) {
        (Some(tp), Some(tsp)) if step_of(tsp) <= step_of(tp) => Some(why_first(tsp, tp)),
        (Some(tp), Some(tsp)) => Some(why_first(tp, tsp)),
        _ => None,
    };
    if let Some(path) = &args.emit_plan {
        let winner = &outcome.plans[0];
        anyhow::ensure!(
            winner.layout.compiles_today(winner.workload.mode),
            crate::usage::UsageError::PlanNotCompilable { layout: winner.estimate.layout.to_string() }
        );
        let choice = PlanChoice::of(&model.name, winner);
        crate::checkpoint::write_file_atomically(path, (serde_json::to_string_pretty(&choice)? + "\n").as_bytes())?;
    }
    match args.format {
        SearchFormat::Json => {
            let object = json!({
                "model": model.name,
                "gpus": args.gpus,
                "hardware": hw.name,
                "seq": args.seq,
                "global_batch": space.global_batch,
                "mem_cap_bytes": cap,
                "costed": outcome.costed,
                "feasible": outcome.feasible,
                "over_memory": outcome.over_memory,
                "indivisible": outcome.indivisible,
                "pruned": outcome.pruned,
                "plans": top.iter().enumerate().map(|(rank, plan)| plan_json(rank + 1, plan)).collect::<Vec<_>>(),
                "single_axis_by_memory": single_by_memory.iter().map(|plan| plan_json(0, plan)).collect::<Vec<_>>(),
                "single_axis_by_time": single_by_time.iter().map(|plan| plan_json(0, plan)).collect::<Vec<_>>(),
                "why_first": why,
                "why_first_single_axis": why_single,
                "tsp_vs_tp": why_tsp_tp,
            });
            crate::json_output::print(object)?;
        }
        SearchFormat::Table => {
            println!(
                "{} on {} x {} ({} a node), seq {}, {} sequences a step, cap {} a GPU: {} plans costed, {} fit \
                 ({} over the cap, {} layouts indivisible, {} skipped as surely over the cap)",
                model.name,
                args.gpus,
                hw.name,
                hw.gpus_per_node,
                args.seq,
                space.global_batch,
                gb(cap),
                outcome.costed,
                outcome.feasible,
                outcome.over_memory,
                outcome.indivisible,
                outcome.pruned
            );
            // (The mesh column fits the longest layout shown: four axes overflow 22 characters.)
            let width = top.iter().map(|plan| plan.estimate.layout.len()).max().unwrap_or(0).max(22);
            println!(
                "{:>4}  {:<width$} {:<38} {:>11} {:>10} {:>10} {:>12} {:>6}",
                "rank", "mesh", "micro-batches, zero, recompute", "memory", "step (s)", "comm (s)", "tok/s/GPU", "MFU"
            );
            for (rank, plan) in top.iter().enumerate() {
                println!(
                    "{:>4}  {:<width$} {:<38} {:>11} {:>10.4} {:>10.4} {:>12.1} {:>5.1}%{}",
                    rank + 1,
                    plan.estimate.layout,
                    describe_workload(&plan.workload),
                    gb(plan.estimate.memory.peak_bytes),
                    plan.estimate.time.step_s,
                    plan.estimate.time.comm_s,
                    plan.estimate.tokens_per_s / plan.layout.world_size() as f64,
                    100.0 * plan.estimate.mfu,
                    if plan.layout.compiles_today(plan.workload.mode) { "" } else { "  (model only)" }
                );
            }
            if args.explain {
                if let Some(why) = &why {
                    println!("why first: {why}");
                }
                for (title, plans) in [("by memory a GPU", &single_by_memory), ("by step time", &single_by_time)] {
                    if plans.is_empty() {
                        continue;
                    }
                    println!("single-axis plans, {title} (the best of each):");
                    for plan in plans.iter() {
                        println!(
                            "  {:<12} {:>11}  step {:.4} s (compute {:.4}, comm {:.4})  {}",
                            plan.estimate.layout,
                            gb(plan.estimate.memory.peak_bytes),
                            plan.estimate.time.step_s,
                            plan.estimate.time.compute_s,
                            plan.estimate.time.comm_s,
                            describe_workload(&plan.workload)
                        );
                    }
                }
                if let Some(why) = &why_single {
                    println!("fastest single axis: {why}");
                }
                if let Some(why) = &why_tsp_tp {
                    println!("tsp against tp: {why}");
                }
            }
            if let Some(path) = &args.emit_plan {
                println!("wrote the winning plan to {}", path.display());
            }
        }
    }
    Ok(())
}

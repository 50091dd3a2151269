//! `pleat explain`: every value's layout in one layer, and every collective with its reason.

use std::fmt::Write;

use anyhow::{bail, Result};
use clap::Args;
use pleat_ir::{AxisName, Mesh};
use pleat_passes::cp::FOLD_CP;
use pleat_passes::explain::{explain_collectives, value_layouts, CollectiveReason};
use pleat_passes::propagate::PROPAGATE_SPECS;
use pleat_passes::rewrite::{rewrite_collectives, RewriteOptions, RewriteReport, StopReason};
use pleat_passes::tsp::FOLD_TSP;
use pleat_passes::{Dump, PassCtx};
use serde_json::json;

use crate::compile::ModelOnMesh;
use crate::run::human_bytes;
use crate::usage::UsageError;

/// Output formats of `explain`.
#[derive(Clone, Copy, clap::ValueEnum, PartialEq, Eq)]
pub enum ExplainFormat {
    Text,
    Json,
    /// Graphviz: one layer, collectives coloured.
    Dot,
}

/// Arguments of `pleat explain`.
#[derive(Args)]
pub struct ExplainArgs {
    /// The model, mesh, strategy and input size.
    #[command(flatten)]
    pub target: ModelOnMesh,
    /// The layer to show (layers are identical).
    #[arg(long, default_value_t = 0)]
    pub layer: u64,
    /// Show only this value (a node name such as `layer0.o_proj`) and the collectives on it.
    #[arg(long)]
    pub value: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = ExplainFormat::Text)]
    pub format: ExplainFormat,
    /// Print egg's proof, rule by rule, of the form `rewrite-collectives` chooses for this value of
    /// the first layer (e.g. `layer0.mlp_residual`), starting from the tensor-parallel form
    /// propagation gives; with `--strategy tp-sp` it shows how sequence parallelism is derived.
    #[arg(long, value_name = "VALUE")]
    pub proof: Option<String>,
    #[command(flatten)]
    pub pipeline: crate::schedule::PipelineFlags,
}

/// What `explain` shows of a pipeline: the stages' layers and the schedule's picture.
struct PipelineView {
    /// Layers a virtual stage.
    layers: Vec<u64>,
    /// The schedule's name.
    schedule: &'static str,
    /// Pipeline ranks.
    stages: u32,
    /// Micro-batches a step.
    micro_batches: u32,
    /// Model chunks a rank.
    chunks: u32,
    /// The picture, bubble and peak in flight, as `pleat schedule` prints them.
    text: String,
}

/// The pipeline `args` ask for on a mesh with `stages` pp ranks; `inner` is the mesh inside a stage.
fn pipeline_view(
    args: &ExplainArgs,
    config: &pleat_ir::model::config::ModelConfig,
    inner: &Mesh,
    stages: u32,
) -> Result<PipelineView> {
    let kind = crate::pipeline::schedule_kind(args.pipeline.schedule, args.pipeline.chunks)?;
    let batch_ranks = crate::pipeline::batch_ranks(inner);
    let micro_batches = args.pipeline.micro_batches_or_default(args.target.batch, stages, batch_ranks);
    let batch = args.target.batch;
    if micro_batches == 0 || batch % u64::from(micro_batches) != 0 {
        bail!(UsageError::BatchNotSplit { batch, micro_batches, valid: pleat_ir::spec::valid_degrees(batch) });
    }
    let virtual_stages = stages * kind.chunks();
    let micro_batch = (batch / u64::from(micro_batches), args.target.seq);
    let sequence_parallel = args.target.strategy == crate::compile::Strategy::TpSp;
    let layers = crate::pipeline::cost_balanced_layers(config, inner, sequence_parallel, micro_batch, virtual_stages)?;
    Ok(PipelineView {
        layers,
        schedule: kind.name(),
        stages,
        micro_batches,
        chunks: kind.chunks(),
        text: crate::schedule::schedule_text(kind, stages, micro_batches)?,
    })
}

impl PipelineView {
    fn text(&self) -> String {
        let mut first = 0;
        let stages: Vec<String> = self
            .layers
            .iter()
            .enumerate()
            .map(|(stage, &count)| {
                let range = format!("stage {stage}: layers {first}..{}", first + count);
                first += count;
                range
            })
            .collect();
        let unit = if self.chunks > 1 { "virtual stage (chunk c of rank r is c·pp + r)" } else { "stage" };
        format!(
            "\npipeline: the layers a {unit}, balanced by the cost model with the embedding on the first and the LM \
             head and loss on the last (--pp-layers overrides in training):\n  {}\n\n{}",
            stages.join(", "),
            self.text
        )
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "schedule": self.schedule,
            "pp": self.stages,
            "micro_batches": self.micro_batches,
            "chunks": self.chunks,
            "layers_per_stage": self.layers,
            "picture": self.text,
        })
    }
}

/// The model built and propagated (the passes before `rewrite-collectives`) under `ctx`.
fn propagated(
    target: &ModelOnMesh,
    config: &pleat_ir::model::config::ModelConfig,
    ctx: &PassCtx,
) -> Result<pleat_ir::Module> {
    let mut module = pleat_ir::model::build(config, target.batch, target.seq)?;
    module.mesh = pleat_ir::Mesh::parse(&target.mesh)?;
    pleat_passes::run_pipeline(&[FOLD_TSP, FOLD_CP, PROPAGATE_SPECS], &mut module, ctx)?;
    Ok(module)
}

/// The proof text for `value`: the module is propagated without sequence parallelism (the tp
/// form) and the rule tables are those the strategy enables.
fn proof(target: &ModelOnMesh, config: &pleat_ir::model::config::ModelConfig, value: &str) -> Result<String> {
    let ctx = target.strategy.pass_ctx(&pleat_ir::Mesh::parse(&target.mesh)?, Dump::Nothing)?;
    let tp_form = PassCtx { sequence_parallel: false, ..ctx.clone() };
    let module = propagated(target, config, &tp_form)?;
    Ok(pleat_passes::rewrite::proof(&module, &ctx, value)?)
}

/// The plan's sharded module, as `pleat compile` builds it (`SHARD_PIPELINE`, verified and lowered
/// to check it compiles), what its `rewrite-collectives` did (its e-graph, the rules that fired,
/// the times) and the transfer instructions of each rank's lowered program. The e-graph runs once,
/// here.
fn sharded_with_report(
    target: &ModelOnMesh,
    config: &pleat_ir::model::config::ModelConfig,
) -> Result<(pleat_ir::Module, RewriteReport, Vec<usize>)> {
    let ctx = target.strategy.pass_ctx(&pleat_ir::Mesh::parse(&target.mesh)?, Dump::Nothing)?;
    let mut module = propagated(target, config, &ctx)?;
    let report = rewrite_collectives(&mut module, &ctx, &RewriteOptions::default())?;
    pleat_passes::verify(&module)?;
    let programs = pleat_backend::lower(&module)?;
    pleat_backend::verify_collectives(&programs)?;
    // A graph's collective is not one transfer: TSP's four broadcasts of an owner's blocks travel
    // packed as one, and a ring's node is a hop a step.
    let transfers = programs
        .iter()
        .map(|program| program.instructions.iter().filter(|instr| instr.is_transfer()).count())
        .collect();
    Ok((module, report, transfers))
}

/// How many transfers the ranks' programs make, when they have any: one count when every rank
/// makes as many, else the fewest and the most.
fn transfers_text(transfers: &[usize]) -> String {
    let (Some(fewest), Some(most)) = (transfers.iter().min(), transfers.iter().max()) else { return String::new() };
    match (fewest, most) {
        (0, 0) => String::new(),
        (1, 1) => " (1 transfer a rank in the programs)".to_string(),
        (fewest, most) if fewest == most => format!(" ({most} transfers a rank in the programs)"),
        (fewest, most) => format!(" ({fewest} to {most} transfers a rank in the programs)"),
    }
}

fn stop_text(stop: &StopReason) -> String {
    match stop {
        StopReason::Saturated => "saturated".to_string(),
        StopReason::IterationLimit(limit) => format!("stopped at the iteration limit ({limit})"),
        StopReason::NodeLimit(nodes) => format!("stopped at the e-node limit ({nodes})"),
        StopReason::TimeLimit(seconds) => format!("stopped at the time limit ({seconds:.1} s)"),
        StopReason::Other(reason) => format!("stopped: {reason}"),
    }
}

fn rewrite_json(report: &RewriteReport) -> serde_json::Value {
    json!({
        "tables": report.tables,
        "stop": stop_text(&report.stop),
        "iterations": report.iterations,
        "enodes": report.enodes,
        "eclasses": report.eclasses,
        "rules_fired": report.rules_fired,
        "layer_seconds_before": report.seconds_before,
        "layer_seconds_after": report.seconds_after,
        "layers_rewritten": report.layers_rewritten,
        "stream_split": report.stream_split,
    })
}

fn rewrite_text(report: &RewriteReport) -> String {
    let mut out = format!(
        "\nrewrite-collectives (egg, one layer template; tables {}): {} after {} iterations, {} e-nodes in {} classes\n",
        report.tables.join(", "),
        stop_text(&report.stop),
        report.iterations,
        report.enodes,
        report.eclasses
    );
    let fired: Vec<String> = report.rules_fired.iter().map(|(rule, count)| format!("{rule} x{count}")).collect();
    let fired = if fired.is_empty() { "none".to_string() } else { fired.join(", ") };
    let _ = writeln!(out, "  rules fired: {fired}");
    let verdict = match (report.layers_rewritten, report.stream_split) {
        (0, _) => "the propagated form is kept".to_string(),
        (layers, false) => format!("the chosen form is written into {layers} layers"),
        (layers, true) => {
            format!("the chosen form is written into {layers} layers, the residual stream split on seq between them")
        }
    };
    let _ = writeln!(
        out,
        "  predicted time a layer: {:.3} us as propagated, {:.3} us chosen; {verdict}",
        report.seconds_before * 1e6,
        report.seconds_after * 1e6
    );
    out
}

fn collective_json(reason: &CollectiveReason) -> serde_json::Value {
    json!({
        "node": reason.node.to_string(),
        "name": reason.name,
        "op": reason.op,
        "axis": reason.axis,
        "dim": reason.dim,
        "bytes_per_rank": reason.bytes_per_rank,
        "rule": reason.rule,
        "reason": reason.reason,
    })
}

/// Runs `pleat explain`.
pub fn explain(args: &ExplainArgs) -> Result<()> {
    let target = &args.target;
    let config = target.config("explain")?;
    if args.layer >= config.num_layers {
        bail!(UsageError::NoSuchLayer { layer: args.layer, model: config.name.clone(), layers: config.num_layers });
    }
    // With a pp axis, the values and collectives are those of one stage's mesh.
    let mesh = Mesh::parse(&target.mesh)?;
    let stages = mesh.degree(AxisName::Pp) as u32;
    let inner = crate::pipeline::inner_mesh(&mesh)?;
    let pipeline = if stages > 1 { Some(pipeline_view(args, &config, &inner, stages)?) } else { None };
    let inner_target = ModelOnMesh {
        model: target.model.clone(),
        mesh: if stages > 1 { inner.to_string() } else { target.mesh.clone() },
        strategy: target.strategy,
        seq: target.seq,
        batch: target.batch,
        no_overlap: target.no_overlap,
        comm_streams: target.comm_streams,
    };
    let target = &inner_target;
    if let Some(value) = &args.proof {
        print!("{}", proof(target, &config, value)?);
        return Ok(());
    }
    let (sharded, rewrite, transfers) = sharded_with_report(target, &config)?;
    let module = &sharded;
    let prefix = format!("layer{}.", args.layer);
    let all = explain_collectives(module);
    let selected =
        |name: &str| args.value.as_deref().is_none_or(|value| name == value || name.starts_with(&format!("{value}.")));
    let values: Vec<_> = value_layouts(module, &prefix).into_iter().filter(|layout| selected(&layout.name)).collect();
    let collectives: Vec<_> = all
        .iter()
        .filter(|reason| args.value.is_some() || reason.layer.is_none_or(|layer| layer == args.layer))
        .filter(|reason| selected(&reason.name))
        .collect();
    if let Some(value) = &args.value {
        if values.is_empty() && collectives.is_empty() {
            bail!(UsageError::NoSuchValue { name: value.clone(), layer: args.layer, prefix });
        }
    }
    match args.format {
        ExplainFormat::Json => {
            let object = json!({
                "model": config.name,
                "mesh": module.mesh.to_string(),
                "layer": args.layer,
                "collectives_per_step": all.len(),
                "transfers_per_rank": transfers,
                "values": values.iter().map(|layout| json!({
                    "value": layout.value.to_string(),
                    "name": layout.name,
                    "op": layout.op,
                    "spec": layout.spec,
                    "bytes_per_rank": layout.bytes_per_rank,
                })).collect::<Vec<_>>(),
                "collectives": collectives.iter().map(|reason| collective_json(reason)).collect::<Vec<_>>(),
                "rewrite": rewrite_json(&rewrite),
                "pipeline": pipeline.as_ref().map(PipelineView::json),
            });
            crate::json_output::print(object)?;
        }
        ExplainFormat::Text => {
            let mut out = String::new();
            let _ = writeln!(
                out,
                "{} on {} (batch {}, seq {}): {} collective{} in a forward pass's graph{}; layer {} and the \
                 model's ends shown",
                config.name,
                if module.mesh.axes().is_empty() { "one rank".to_string() } else { module.mesh.to_string() },
                target.batch,
                target.seq,
                all.len(),
                if all.len() == 1 { "" } else { "s" },
                transfers_text(&transfers),
                args.layer
            );
            let _ = writeln!(out, "\nvalues (global shape with splits; bytes a rank):");
            let width = values.iter().map(|layout| layout.name.len()).max().unwrap_or(0);
            for layout in &values {
                let _ = writeln!(
                    out,
                    "  {:<width$}  {:<16} {}  {}",
                    layout.name,
                    layout.op,
                    layout.spec,
                    human_bytes(layout.bytes_per_rank)
                );
            }
            let _ = writeln!(out, "\ncollectives:");
            for reason in &collectives {
                let dim = reason.dim.as_ref().map(|dim| format!(" on {dim}")).unwrap_or_default();
                let _ = writeln!(
                    out,
                    "  {} {}: {} over {}{dim}, {} a rank [{}]\n      {}",
                    reason.node,
                    reason.name,
                    reason.op,
                    reason.axis,
                    human_bytes(reason.bytes_per_rank),
                    reason.rule,
                    reason.reason
                );
            }
            out.push_str(&rewrite_text(&rewrite));
            if let Some(pipeline) = &pipeline {
                out.push_str(&pipeline.text());
            }
            print!("{out}");
        }
        ExplainFormat::Dot => print!("{}", dot(module, &prefix)),
    }
    Ok(())
}

/// A Graphviz picture of one layer: values as boxes, collectives filled.
fn dot(module: &pleat_ir::Module, prefix: &str) -> String {
    let graph = &module.graph;
    let in_layer = |node: pleat_ir::NodeId| graph.node(node).name.starts_with(prefix);
    let mut out = String::from("digraph layer {\n  rankdir=TB;\n  node [shape=box, fontname=\"monospace\"];\n");
    for &node in graph.order().iter().filter(|&&node| in_layer(node)) {
        let data = graph.node(node);
        let value = graph.value(data.result);
        let spec = pleat_passes::sharding::spec_text(&value.spec, &value.ty.shape);
        let style = if data.op.is_communication() { ", style=filled, fillcolor=\"#f4a261\"" } else { "" };
        let _ = writeln!(out, "  {node} [label=\"{}\\n{}\\n{spec}\"{style}];", data.name, data.op.mnemonic());
        for &input in &data.inputs {
            let source = graph.value(input).def;
            if in_layer(source) {
                let _ = writeln!(out, "  {source} -> {node};");
            }
        }
    }
    out.push_str("}\n");
    out
}

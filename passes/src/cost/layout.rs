//! A parallel layout: the degree of each mesh axis, in mesh order, and what each axis splits.
//!
//! Axes mean what they mean in `ir::mesh` and DESIGN.md section 4: `dp` splits the batch, `tp`
//! splits weights (Megatron), `sp` splits the sequence with weights replicated (the orthogonal SP
//! axis of the TSP paper's TP+SP layouts; attention all-gathers K/V), `cp` splits the sequence with
//! ring attention, `pp` splits layers, `tsp` splits both weights and tokens, `ep` splits a mixture's
//! routed experts and, as data parallelism does, the batch: each ep rank runs the attention and
//! the router on sequences of its own and sends their tokens to the ranks of their experts.
//! Megatron's sequence parallelism inside the tp group (Korthikanti et al.) is not an axis of its
//! own: it is the [`Layout::sequence_parallel`] flag on `tp`.
//!
//! Validation follows the strategies' rules: an axis that splits heads or channels must divide
//! them, a sequence split must divide the tokens (twice the degree for the zigzag layouts of cp
//! and tsp). The vocabulary is padded, as Megatron pads it, rather than refused.

use pleat_ir::spec::valid_degrees;
use pleat_ir::{AxisName, Mesh};

use super::model::ModelShape;
use super::workload::{Mode, Workload};
use super::{CostError, Result};

/// The degrees of the mesh axes, in mesh order, plus Megatron sequence parallelism on `tp`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Layout {
    axes: Vec<(AxisName, u64)>,
    /// Megatron sequence parallelism on the tp group: norms, dropout and residuals split on seq,
    /// all-gather / reduce-scatter in place of the all-reduces.
    pub sequence_parallel: bool,
}

/// How an axis's groups sit on nodes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct AxisSpan {
    /// The group's ranks on one node.
    pub ranks_per_node: u64,
    /// The nodes one group spans.
    pub nodes: u64,
}

impl Layout {
    /// The layout of `mesh`; `sequence_parallel` turns on Megatron SP for its tp axis. Its axes of
    /// one rank are dropped, as the compiler drops them (`Mesh::without_unit_axes`).
    pub fn from_mesh(mesh: &Mesh, sequence_parallel: bool) -> Layout {
        let axes: Vec<_> = mesh.axes().iter().map(|axis| (axis.name, axis.size)).collect();
        Layout::new(&axes, sequence_parallel)
    }

    /// A layout from `(axis, degree)` pairs, outermost first; axes of degree 1 are dropped.
    pub fn new(axes: &[(AxisName, u64)], sequence_parallel: bool) -> Layout {
        Layout { axes: axes.iter().copied().filter(|&(_, degree)| degree != 1).collect(), sequence_parallel }
    }

    /// The degree of `axis` (1 when absent).
    pub fn degree(&self, axis: AxisName) -> u64 {
        self.axes.iter().find(|(name, _)| *name == axis).map_or(1, |&(_, degree)| degree)
    }

    /// The axes, outermost first.
    pub fn axes(&self) -> &[(AxisName, u64)] {
        &self.axes
    }

    /// Ranks in all.
    pub fn world_size(&self) -> u64 {
        self.axes.iter().map(|&(_, degree)| degree).product()
    }

    /// How many ways the batch is split: dp, and ep (which splits the batch as dp does, and the
    /// routed experts besides). Each of these ranks sees a micro-batch of its own.
    pub fn batch_split(&self) -> u64 {
        self.degree(AxisName::Dp) * self.degree(AxisName::Ep)
    }

    /// The replicas of a dense parameter, which ZeRO shards it over: dp, cp (whose ranks hold the
    /// same weights and sum their gradients, as Megatron's distributed optimizer shards over
    /// dp × cp) and ep (which splits the batch as dp does). `pleat_ir::ZERO_AXES`.
    pub fn zero_replicas(&self) -> u64 {
        self.degree(AxisName::Dp) * self.degree(AxisName::Cp) * self.degree(AxisName::Ep)
    }

    /// The replicas of a routed expert, which ZeRO shards it over: dp and cp (ep splits them).
    pub fn expert_zero_replicas(&self) -> u64 {
        self.degree(AxisName::Dp) * self.degree(AxisName::Cp)
    }

    /// The axis a mixture's routed experts are split over: `ep`, or `tsp` when there is no ep
    /// (its tokens are already split over it, so the same ranks dispatch them to their experts);
    /// `None` when neither splits anything.
    pub fn expert_axis(&self) -> Option<AxisName> {
        [AxisName::Ep, AxisName::Tsp].into_iter().find(|&axis| self.degree(axis) > 1)
    }

    /// How many ways the routed experts are split ([`Self::expert_axis`]'s degree, 1 when none).
    pub fn expert_degree(&self) -> u64 {
        self.expert_axis().map_or(1, |axis| self.degree(axis))
    }

    /// The ranks that hold one copy of the model (everything but dp).
    pub fn model_parallel_size(&self) -> u64 {
        self.world_size() / self.degree(AxisName::Dp)
    }

    /// How many ways the tokens of a sequence are split on every rank, before Megatron SP (which
    /// splits only norms and residuals).
    pub fn sequence_split(&self) -> u64 {
        self.degree(AxisName::Sp) * self.degree(AxisName::Cp) * self.degree(AxisName::Tsp)
    }

    /// How many ways a layer's matrices are split on every rank.
    pub fn weight_split(&self) -> u64 {
        self.degree(AxisName::Tp) * self.degree(AxisName::Tsp)
    }

    /// A short name: `tp=4 x sp=2`, `tp=8+sp` (Megatron SP), `1 rank`.
    pub fn label(&self) -> String {
        if self.axes.is_empty() {
            return "1 rank".to_string();
        }
        self.axes
            .iter()
            .map(|&(axis, degree)| {
                let megatron_sp = axis == AxisName::Tp && self.sequence_parallel;
                format!("{axis}={degree}{}", if megatron_sp { "+sp" } else { "" })
            })
            .collect::<Vec<_>>()
            .join(" x ")
    }

    /// Whether pleat's compiler has strategies for every axis of this layout today in `mode`
    /// (Megatron SP on tp is `--strategy tp-sp`; pp pipelines training steps), none of them a pair
    /// it refuses together (tsp beside tp or cp); the cost model covers the others analytically.
    pub fn compiles_today(&self, mode: Mode) -> bool {
        let compiled = compiled_axes(mode);
        self.axes.iter().all(|(axis, _)| compiled.contains(axis)) && self.refused_pair().is_none()
    }

    /// The pair of this layout's axes the compiler refuses together, for good (`E0209`), and why.
    pub fn refused_pair(&self) -> Option<(AxisName, AxisName, &'static str)> {
        let has = |axis: AxisName| self.axes.iter().any(|&(name, _)| name == axis);
        crate::strategy::CONFLICTING_AXES.iter().copied().find(|&(first, second, _)| has(first) && has(second))
    }

    /// How the groups of `axis` sit on nodes of `gpus_per_node` GPUs (ranks are numbered row-major
    /// over the axes, so the innermost axis is packed in a node first).
    pub fn span(&self, axis: AxisName, gpus_per_node: u64) -> AxisSpan {
        let Some(position) = self.axes.iter().position(|(name, _)| *name == axis) else {
            return AxisSpan { ranks_per_node: 1, nodes: 1 };
        };
        let degree = self.axes[position].1;
        let stride: u64 = self.axes[position + 1..].iter().map(|&(_, degree)| degree).product();
        let gpus_per_node = gpus_per_node.max(1);
        let ranks_per_node = if stride >= gpus_per_node { 1 } else { (gpus_per_node / stride).clamp(1, degree) };
        AxisSpan { ranks_per_node, nodes: degree.div_ceil(ranks_per_node) }
    }

    /// What `axis` splits, each as (what, count, chunks a rank): a degree `d` above 1 needs
    /// `count` divisible by `chunks · d`.
    fn splits(&self, model: &ModelShape, workload: &Workload, axis: AxisName) -> Vec<(String, u64, u64)> {
        let seq = workload.seq;
        // Zigzag: 2·D chunks of the sequence for cp and tsp.
        let zigzag = || (format!("tokens (seq; zigzag needs 2·{axis} chunks)"), seq, 2);
        let mut splits = match axis {
            AxisName::Tp => {
                let mut splits =
                    vec![("heads".to_string(), model.heads, 1), ("ffn channels".to_string(), model.ffn, 1)];
                if self.sequence_parallel {
                    let local_seq = seq / self.sequence_split();
                    splits.push(("tokens (seq) after the sequence split".to_string(), local_seq, 1));
                }
                splits
            }
            // TSP owners hold whole kv heads; tp keeps k/v whole when they do not divide (strategy.rs).
            AxisName::Tsp => vec![
                ("heads".to_string(), model.heads, 1),
                ("ffn channels".to_string(), model.ffn, 1),
                ("kv heads".to_string(), model.kv_heads, 1),
                zigzag(),
            ],
            AxisName::Cp => vec![zigzag()],
            AxisName::Sp => vec![("tokens (seq)".to_string(), seq, 1)],
            _ => Vec::new(),
        };
        if let Some(experts) = &model.experts {
            if self.expert_axis() == Some(axis) {
                splits.push(("experts".to_string(), experts.count, 1));
            }
            // Expert tensor parallelism splits each expert's channels over tp; beside ep, tsp
            // keeps experts whole (each tsp rank runs its own tokens through its ep share).
            if axis == AxisName::Tp {
                splits.push(("expert ffn channels".to_string(), experts.ffn, 1));
            }
        }
        splits
    }

    /// Checks the layout against the model and workload.
    pub fn validate(&self, model: &ModelShape, workload: &Workload) -> Result<()> {
        let seq = workload.seq;
        for axis in [AxisName::Tp, AxisName::Tsp, AxisName::Sp, AxisName::Cp, AxisName::Ep] {
            let degree = self.degree(axis);
            let splits = self.splits(model, workload, axis);
            let fits =
                |degree: u64| degree == 1 || splits.iter().all(|(_, count, chunks)| count % (chunks * degree) == 0);
            let failed = splits.iter().find(|(_, count, chunks)| degree > 1 && count % (chunks * degree) != 0);
            let Some((what, count, _)) = failed else { continue };
            // Every degree that splits all of them, not just the first that failed.
            let valid = splits.first().map_or_else(Vec::new, |(_, first, _)| valid_degrees(*first));
            return Err(CostError::Indivisible {
                what: what.clone(),
                count: *count,
                axis: axis.to_string(),
                degree,
                valid: valid.into_iter().filter(|&degree| fits(degree)).collect(),
            });
        }
        if seq % self.sequence_split() != 0 {
            return Err(CostError::Indivisible {
                what: "tokens (seq) under sp x cp x tsp".to_string(),
                count: seq,
                axis: "sp x cp x tsp".to_string(),
                degree: self.sequence_split(),
                valid: valid_degrees(seq),
            });
        }
        let stages = self.degree(AxisName::Pp);
        if stages > model.layers {
            return Err(CostError::TooManyStages { stages, layers: model.layers });
        }
        let ep = self.degree(AxisName::Ep);
        match &model.experts {
            None if ep > 1 => {
                return Err(CostError::UnusableAxis {
                    axis: "ep".to_string(),
                    degree: ep,
                    reason: format!("{} has no experts (a dense MLP); drop ep or use dp", model.name),
                });
            }
            _ => {}
        }
        if self.sequence_parallel && self.degree(AxisName::Tp) == 1 {
            return Err(CostError::UnusableAxis {
                axis: "tp".to_string(),
                degree: 1,
                reason: "sequence parallelism runs on the tp group; add tp=2 or more".to_string(),
            });
        }
        Ok(())
    }
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.label())
    }
}

/// The axes pleat compiles in `mode`: those with a strategy, and under training pp, whose
/// stages each compile over the others (a forward pass refuses it, E0215).
pub fn compiled_axes(mode: Mode) -> Vec<AxisName> {
    let mut axes = crate::strategy::SUPPORTED_AXES.to_vec();
    if mode == Mode::Train {
        axes.push(AxisName::Pp);
    }
    axes
}

#[cfg(test)]
mod tests {
    use super::*;
    use pleat_ir::model::preset::preset;

    fn tsp_7b() -> ModelShape {
        ModelShape::from_config(&preset("tsp-7b").unwrap())
    }

    #[test]
    fn spans_follow_row_major_ranks() {
        let layout = Layout::from_mesh(&Mesh::parse("dp=4,pp=2,tp=8").unwrap(), false);
        assert_eq!(layout.span(AxisName::Tp, 8), AxisSpan { ranks_per_node: 8, nodes: 1 });
        assert_eq!(layout.span(AxisName::Pp, 8), AxisSpan { ranks_per_node: 1, nodes: 2 });
        assert_eq!(layout.span(AxisName::Dp, 8), AxisSpan { ranks_per_node: 1, nodes: 4 });
        let small = Layout::from_mesh(&Mesh::parse("dp=8,tp=2").unwrap(), false);
        assert_eq!(small.span(AxisName::Dp, 8), AxisSpan { ranks_per_node: 4, nodes: 2 });
        assert_eq!(small.world_size(), 16);
        assert_eq!(small.model_parallel_size(), 2);
    }

    #[test]
    fn labels() {
        assert_eq!(Layout::new(&[(AxisName::Tp, 4), (AxisName::Sp, 2)], false).label(), "tp=4 x sp=2");
        assert_eq!(Layout::new(&[(AxisName::Tp, 8)], true).label(), "tp=8+sp");
        assert_eq!(Layout::new(&[], false).label(), "1 rank");
    }

    #[test]
    fn validation_names_the_axis_and_the_fix() {
        let workload = Workload::training(4096, 1);
        let bad_tp = Layout::new(&[(AxisName::Tp, 3)], false).validate(&tsp_7b(), &workload).unwrap_err();
        assert_eq!(bad_tp.to_string(), "32 heads are not divisible by tp=3; use tp in {1,2,4,8,16,32}");
        let zigzag = Layout::new(&[(AxisName::Tsp, 8)], false).validate(&tsp_7b(), &Workload::training(8, 1));
        assert_eq!(
            zigzag.unwrap_err().to_string(),
            "8 tokens (seq; zigzag needs 2·tsp chunks) are not divisible by tsp=8; use tsp in {1,2,4}"
        );
        let experts = Layout::new(&[(AxisName::Ep, 2)], false).validate(&tsp_7b(), &workload).unwrap_err();
        assert_eq!(experts.to_string(), "mesh axis ep=2: tsp-7b has no experts (a dense MLP); drop ep or use dp");
        let stages = Layout::new(&[(AxisName::Pp, 64)], false).validate(&tsp_7b(), &workload).unwrap_err();
        assert_eq!(stages.to_string(), "pp=64 is more than the model's 32 layers; use pp <= 32");
        assert!(Layout::new(&[(AxisName::Tp, 4), (AxisName::Cp, 2)], true).validate(&tsp_7b(), &workload).is_ok());
    }

    #[test]
    fn ep_splits_the_experts_of_a_mixture_only() {
        let workload = Workload::training(4096, 1);
        let mixtral = ModelShape::from_config(&preset("mixtral-8x7b").unwrap());
        for ep in [1, 2, 4, 8] {
            let layout = Layout::new(&[(AxisName::Ep, ep), (AxisName::Tp, 2)], false);
            assert!(layout.validate(&mixtral, &workload).is_ok(), "ep={ep}");
            assert_eq!(layout.batch_split(), ep);
        }
        let three = Layout::new(&[(AxisName::Ep, 3)], false).validate(&mixtral, &workload).unwrap_err();
        assert_eq!(three.to_string(), "8 experts are not divisible by ep=3; use ep in {1,2,4,8}");
        let tiny_moe = ModelShape::from_config(&preset("tiny-moe").unwrap());
        // tiny-moe's 8 heads stop any tp that would not divide its experts' 64 channels; with 48
        // heads, tp=48 passes the heads and reaches the experts' check. The degrees it suggests
        // split both: 48's divisors that divide 64.
        let wide_heads = ModelShape { heads: 48, kv_heads: 48, ..tiny_moe };
        let channels = Layout::new(&[(AxisName::Tp, 48)], false).validate(&wide_heads, &workload).unwrap_err();
        assert_eq!(channels.to_string(), "64 expert ffn channels are not divisible by tp=48; use tp in {1,2,4,8,16}");
        // tsp splits the heads, the kv heads and the zigzag's 2·tsp chunks: llama3-8b's 8 kv heads
        // leave {1, 2, 4, 8} of 32 heads' divisors, whichever of them failed.
        let llama = ModelShape::from_config(&preset("llama3-8b").unwrap());
        for tsp in [6, 16] {
            let error = Layout::new(&[(AxisName::Tsp, tsp)], false).validate(&llama, &workload).unwrap_err();
            assert!(error.to_string().ends_with("use tsp in {1,2,4,8}"), "{error}");
        }
        let dense = Layout::new(&[(AxisName::Ep, 2)], false).validate(&tsp_7b(), &workload).unwrap_err();
        assert!(matches!(dense, CostError::UnusableAxis { .. }), "{dense}");
    }

    #[test]
    fn layouts_of_the_compiled_strategies_compile_today() {
        for mode in [Mode::Train, Mode::Infer] {
            assert!(Layout::new(&[(AxisName::Dp, 2), (AxisName::Tp, 2)], false).compiles_today(mode));
            // Megatron SP on tp is `--strategy tp-sp`.
            assert!(Layout::new(&[(AxisName::Tp, 2)], true).compiles_today(mode));
            assert!(Layout::new(&[(AxisName::Dp, 2), (AxisName::Tsp, 4)], false).compiles_today(mode));
            assert!(Layout::new(&[(AxisName::Cp, 2)], false).compiles_today(mode));
            assert!(!Layout::new(&[(AxisName::Sp, 2)], false).compiles_today(mode));
            // Axes the compiler has, in pairs it refuses.
            assert!(!Layout::new(&[(AxisName::Tsp, 2), (AxisName::Tp, 2)], false).compiles_today(mode));
            assert!(!Layout::new(&[(AxisName::Cp, 2), (AxisName::Tsp, 2)], false).compiles_today(mode));
        }
        // pp pipelines a training step; a forward pass refuses it.
        let pipelined = Layout::new(&[(AxisName::Pp, 2), (AxisName::Tp, 2)], false);
        assert!(pipelined.compiles_today(Mode::Train));
        assert!(!pipelined.compiles_today(Mode::Infer));
        assert!(!Layout::new(&[(AxisName::Pp, 2), (AxisName::Sp, 2)], false).compiles_today(Mode::Train));
        // An axis of one rank is no axis.
        let unit = Layout::from_mesh(&Mesh::parse("pp=1,sp=1,tp=2").unwrap(), false);
        assert!(unit.compiles_today(Mode::Infer) && unit.to_string() == "tp=2", "{unit}");
        assert!(Layout::from_mesh(&Mesh::parse("tsp=2,cp=1").unwrap(), false).compiles_today(Mode::Train));
    }
}

//! The peak of a compiled inference forward, from closed forms, term by term.
//!
//! [`super::memory`] models a device runtime: weights, a KV cache, and the larger of the logits and
//! one layer's transients. A compiled `Program` (the backend's lowering of `--mesh` for one rank)
//! is more particular: it loads each parameter when first used, keeps no KV cache (K/V are freed
//! after each layer's attention), assembles the whole logits on every rank, and stages each
//! collective's data while it runs. The backend's liveness planner (`backend::memory::plan`)
//! measures that program's peak; [`compiled_forward_peak`] predicts it from the model's sizes,
//! phase by phase, each live buffer a named [`Term`], and [`differences_from_closed_form`] names
//! every term by which it differs from [`super::memory`]'s peak, so that `closed form + differences
//! = planner` exactly (`tests/cost_planner.rs` checks it for tp, tp with Megatron SP, tsp, cp and
//! dp at degrees 2 and 4, and for two mixtures of experts on ep, tsp, dp and tp).
//!
//! The phases modelled are those where the compiled forwards peak:
//! - **logits**: all parameters, plus what the layout holds while the logits are assembled. One
//!   rank: the final norm's output `[T, h]` and the logits `[T, V]` (`T = s·b`). tp (with or
//!   without Megatron SP): its vocabulary shard `[T, V/tp]` and the all-gather's staging `[T, V]`.
//!   dp: its batch shard `[T/dp, V]` and the staging. cp: the gathered `[T, V]` and its un-zigzagged
//!   copy. tsp: the un-zigzagged vocabulary shard `[T, V/D]` and the staging.
//! - **tsp mlp ring** (tsp only), inside the last layer, before the final norm and the LM head are
//!   loaded: the residual stream, the MLP norm's output and the ring's accumulator (`[T/D, h]`
//!   each), the received shard of the gated MLP (`3·h·f/D`), and either one step's gate, up and
//!   product (`3·T/D·f/D`) or, from the third step on (`D >= 3`), the next shard arriving before
//!   the held one is freed (`3·h·f/D` of staging).
//!
//! - **expert dispatch** (a mixture of experts with an expert axis, ep or tsp), inside the last
//!   layer's dispatched mixture, before its shared expert (if any), the final norm and the LM head
//!   are loaded: the residual stream and the MLP norm's output (`[T_local, h]` each) and the
//!   instruction's copy of its operands: the rows, the router `[E, h]` and the rank's experts
//!   (`E/ep · 3·h·f_e/tp`). The messages it sends and receives are sized by the routing, and
//!   neither the planner nor the executor counts them.
//!
//! dp and ep split the batch alike: the program's batch is the replica's times both.
//!
//! [`super::compiled_training`] does the same for a training step's program, which peaks at the
//! head of its backward, inside a layer's backward, or at its end.
//!
//! The peak is the larger phase. Other phases (a layer's attention, TSP's weight broadcasts) are
//! smaller at the sizes the tests compile; a layout whose peak fell there would make the planner's
//! figure exceed this one, which the test would report.

use pleat_ir::AxisName;

use super::layout::Layout;
use super::memory::{stage_params, MemoryBreakdown, Term};
use super::model::ModelShape;
use super::workload::Workload;

/// One phase of the compiled forward: the live buffers at its highest point, by name.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ForwardPhase {
    /// `logits`, `tsp mlp ring` or `expert dispatch`.
    pub name: &'static str,
    /// Parameters loaded by then (bytes).
    pub params: f64,
    /// Everything else live (or staged) then.
    pub terms: Vec<Term>,
}

impl ForwardPhase {
    /// Parameters plus every term, in whole bytes (a term that splits a buffer over three
    /// replicas, say, is a fraction, which the others' make whole again up to rounding).
    pub fn bytes(&self) -> f64 {
        (self.params + self.terms.iter().map(|term| term.bytes).sum::<f64>()).round()
    }
}

/// The predicted peak of a compiled forward on one rank.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct CompiledForwardPeak {
    /// Every phase modelled.
    pub phases: Vec<ForwardPhase>,
    /// Parameters of the whole rank (bytes), loaded by the end.
    pub all_params: f64,
}

impl CompiledForwardPeak {
    /// The phase with the most bytes.
    pub fn peak_phase(&self) -> &ForwardPhase {
        self.phases.iter().max_by(|a, b| a.bytes().total_cmp(&b.bytes())).expect("the logits phase is always modelled")
    }

    /// The predicted peak (bytes).
    pub fn peak_bytes(&self) -> f64 {
        self.peak_phase().bytes()
    }
}

/// The compiled forward's phases for `model` on `layout` (one rank, no pp), elements of the model's
/// dtype. `workload` is in the cost model's terms: `micro_batch` sequences a replica, so the
/// program's batch is `micro_batch · dp`.
pub fn compiled_forward_peak(model: &ModelShape, layout: &Layout, workload: &Workload) -> CompiledForwardPeak {
    // The compiler splits the embedding and the LM head over tsp too (vocab-parallel).
    let compiled = Workload { tsp_shards_embeddings: true, ..workload.clone() };
    let element = model.dtype_bytes as f64;
    let all_params = stage_params(model, layout, &compiled, 0, model.layers) * element;
    // dp, and ep beside it, split the batch: each holds a replica's sequences.
    let (replicas, cp) = (layout.batch_split() as f64, layout.degree(AxisName::Cp) as f64);
    // The program's whole batch: every rank assembles all of its logits.
    let tokens = (workload.seq * workload.micro_batch) as f64 * replicas;
    let (hidden, vocab) = (model.hidden as f64, model.vocab as f64);
    let (tp, tsp) = (layout.degree(AxisName::Tp) as f64, layout.degree(AxisName::Tsp) as f64);
    let whole_logits = tokens * vocab * element;

    let mut logits = Vec::new();
    if tp > 1.0 || tsp > 1.0 {
        let shard = (vocab / (tp * tsp)).ceil() * tokens * element;
        let name = if tsp > 1.0 { "un-zigzagged logits, vocabulary shard" } else { "logits, vocabulary shard" };
        logits.push(Term { name, bytes: shard });
        logits.push(Term { name: "all-gather staging of the logits", bytes: whole_logits });
    } else if replicas > 1.0 {
        logits.push(Term { name: "logits, batch shard", bytes: whole_logits / replicas });
        logits.push(Term { name: "all-gather staging of the logits", bytes: whole_logits });
    } else if cp > 1.0 {
        logits.push(Term { name: "cp all-gathered logits", bytes: whole_logits });
        logits.push(Term { name: "un-zigzagged copy of the logits", bytes: whole_logits });
    } else {
        logits.push(Term { name: "final norm output", bytes: tokens * hidden * element });
        logits.push(Term { name: "logits", bytes: whole_logits });
    }
    let mut phases = vec![ForwardPhase { name: "logits", params: all_params, terms: logits }];
    // The final norm and the LM head's shard, loaded only after the last layer.
    let head = model.final_norm_params() as f64
        + if model.tied_embeddings { 0.0 } else { (vocab / (tp * tsp)).ceil() * hidden };

    if tsp > 1.0 {
        let local_tokens = tokens / tsp;
        let shard = model.mlp_weights() as f64 / tsp * element;
        let step_hidden = 3.0 * local_tokens * model.ffn as f64 / tsp * element;
        let stream = local_tokens * hidden * element;
        let mut terms = vec![
            Term { name: "residual stream", bytes: stream },
            Term { name: "mlp norm output", bytes: stream },
            Term { name: "ring accumulator", bytes: stream },
            Term { name: "held mlp shard (gate, up, down)", bytes: shard },
        ];
        // From the third step on the next shard arrives before the held one is freed.
        if tsp >= 3.0 && shard > step_hidden {
            terms.push(Term { name: "next mlp shard being received (staging)", bytes: shard });
        } else {
            terms.push(Term { name: "ring step's gate, up and product", bytes: step_hidden });
        }
        phases.push(ForwardPhase { name: "tsp mlp ring", params: all_params - head * element, terms });
    }
    if let (Some(experts), Some(axis)) = (&model.experts, layout.expert_axis()) {
        // The last layer's mixture, dispatched over the expert axis: the instruction works from a
        // copy of its operands (the rows, the router and the rank's experts), which the executor
        // stages while it runs.
        let local_tokens = tokens / (replicas * layout.sequence_split() as f64);
        let stream = local_tokens * hidden * element;
        let local_experts = (experts.count / layout.degree(axis)) as f64;
        let operands = stream
            + experts.count as f64 * hidden * element
            + local_experts * model.expert_weights() as f64 / tp * element;
        let terms = vec![
            Term { name: "residual stream", bytes: stream },
            Term { name: "mlp norm output", bytes: stream },
            Term { name: "expert dispatch staging (rows, router, the rank's experts)", bytes: operands },
        ];
        // A shared expert (Qwen2-MoE) runs after the routed ones: the last layer's is not loaded
        // yet either (its matrices split as the dense MLP's are, its gate whole).
        let shared = if experts.shared_expert { model.mlp_weights() as f64 / (tp * tsp) + hidden } else { 0.0 };
        let params = all_params - (head + shared) * element;
        phases.push(ForwardPhase { name: "expert dispatch", params, terms });
    }
    CompiledForwardPeak { phases, all_params }
}

/// The terms by which the compiled forward's peak differs from [`super::memory`]'s inference peak
/// `memory` of the same model, layout and workload: `memory.peak_bytes` plus these is
/// `compiled.peak_bytes()`. Removed (negative): the KV cache the compiled prefill does not keep,
/// the closed form's larger-of-logits-and-transients, and the parameters not loaded yet at the
/// peak; added: the peak phase's live buffers.
pub fn differences_from_closed_form(memory: &MemoryBreakdown, compiled: &CompiledForwardPeak) -> Vec<Term> {
    let phase = compiled.peak_phase();
    let mut terms = vec![
        Term { name: "kv cache (the compiled prefill keeps none)", bytes: -memory.activations_bytes },
        Term {
            name: "closed form's logits or layer transients",
            bytes: -f64::max(memory.logits_bytes, memory.transient_bytes),
        },
        Term { name: "parameters not loaded yet at the peak", bytes: phase.params - compiled.all_params },
        // Zero when the closed form's static bytes are the program's parameters (the test checks).
        Term {
            name: "parameters the closed form counts otherwise",
            bytes: compiled.all_params - memory.static_bytes(),
        },
    ];
    terms.extend(phase.terms.iter().cloned());
    terms
}

/// The inference workload of a compiled forward in the cost model's terms: `seq` tokens, `batch`
/// sequences a replica (a program compiled for batch B on dp ranks has `batch = B / dp`), the
/// embedding and LM head split over tsp as the compiler splits them.
pub fn compiled_workload(seq: u64, batch: u64) -> Workload {
    Workload { tsp_shards_embeddings: true, ..Workload::inference(seq, batch) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::memory::memory_per_stage;
    use pleat_ir::model::preset::preset;

    fn tiny() -> ModelShape {
        ModelShape::from_config(&preset("tiny").unwrap())
    }

    #[test]
    fn one_rank_peaks_at_the_logits() {
        // tiny: h 128, V 256, f32; 16 tokens: final norm 16·128·4 and logits 16·256·4 bytes.
        let model = tiny();
        let peak = compiled_forward_peak(&model, &Layout::new(&[], false), &compiled_workload(8, 2));
        assert_eq!(peak.all_params, model.param_count() as f64 * 4.0);
        assert_eq!(peak.peak_phase().name, "logits");
        assert_eq!(peak.peak_bytes(), peak.all_params + 16.0 * 128.0 * 4.0 + 16.0 * 256.0 * 4.0);
    }

    #[test]
    fn tsp_ring_phase_by_hand() {
        // tsp=2, 16 tokens: 8 local; shard 3·128·256/2 elements; step 3·8·128 elements; the final
        // norm (128) and the LM head shard (128 rows of 128) not loaded yet.
        let model = tiny();
        let peak = compiled_forward_peak(&model, &Layout::new(&[(AxisName::Tsp, 2)], false), &compiled_workload(8, 2));
        let ring = peak.phases.iter().find(|phase| phase.name == "tsp mlp ring").unwrap();
        assert_eq!(ring.params, peak.all_params - (128.0 + 128.0 * 128.0) * 4.0);
        let want = 3.0 * 8.0 * 128.0 + 3.0 * 128.0 * 256.0 / 2.0 + 3.0 * 8.0 * 128.0;
        assert_eq!(ring.bytes() - ring.params, want * 4.0);
    }

    #[test]
    fn expert_dispatch_phase_by_hand() {
        // tiny-moe on ep=2, 2 sequences of 8 a replica: 16 local rows of 128. The last layer's
        // dispatch copies the rows (16·128), the router (8·128) and the rank's 4 experts
        // (4·3·128·64); the residual stream and the norm's output are live; the final norm (128)
        // and the LM head (256·128) are not loaded yet.
        let model = ModelShape::from_config(&preset("tiny-moe").unwrap());
        let peak = compiled_forward_peak(&model, &Layout::new(&[(AxisName::Ep, 2)], false), &compiled_workload(8, 2));
        let dispatch = peak.phases.iter().find(|phase| phase.name == "expert dispatch").unwrap();
        assert_eq!(dispatch.params, peak.all_params - (128.0 + 256.0 * 128.0) * 4.0);
        let want = 2.0 * 16.0 * 128.0 + 16.0 * 128.0 + 8.0 * 128.0 + 4.0 * 3.0 * 128.0 * 64.0;
        assert_eq!(dispatch.bytes() - dispatch.params, want * 4.0);
        assert_eq!(peak.peak_phase().name, "expert dispatch");
    }

    #[test]
    fn differences_add_up() {
        let model = tiny();
        let workload = compiled_workload(8, 2);
        for axes in [vec![(AxisName::Tp, 2)], vec![(AxisName::Tsp, 4)], vec![(AxisName::Cp, 2)], vec![]] {
            let layout = Layout::new(&axes, false);
            let memory = &memory_per_stage(&model, &layout, &workload)[0];
            let compiled = compiled_forward_peak(&model, &layout, &workload);
            let sum: f64 = differences_from_closed_form(memory, &compiled).iter().map(|term| term.bytes).sum();
            assert!((memory.peak_bytes + sum - compiled.peak_bytes()).abs() < 1e-6, "{layout}");
        }
    }
}

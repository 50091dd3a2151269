//! The single-device reference a forward run's `--check` compares with, and the tokens it judges.
//!
//! The reference interpreter runs the unsharded graph at the programs' precision: in f32, or, for
//! bf16 programs, with every bf16 value rounded as the runtime stores it
//! (`pleat_ir::interp::run_as_stored`). The two then differ by summation order and the last bits
//! it flips, not by the compounded difference between two precisions.
//!
//! A mixture of experts' top-k routing is piecewise constant. Where a token's router logits are
//! within rounding of choosing another expert, the run and the reference may route it differently,
//! and its logits then differ by the experts' difference, not by rounding. The reference measures
//! each token's gap at every mixture (`pleat_ir::interp::routing_margins`). A token whose gap is
//! under the precision's tie margin is reported, not judged; so is every later token of its
//! sequence when an attention follows that mixture, since attention carries the token's changed
//! state to them (every token of the sequence, if that attention is not causal).

use anyhow::Result;
use pleat_backend::{DType, Program};
use pleat_ir::interp::{routing_margins, run_all_as_stored, run_as_stored, Inputs};
use pleat_ir::model::config::{ConfigDtype, ModelConfig};
use pleat_ir::{Graph, Op};
use pleat_runtime::weights::WeightSource;

use crate::device::CUDA_F32_TOL;
use crate::inputs::Tokens;
use crate::run::{max_abs_diff, nan_max, F32_TOL};

/// The router-logit gap, relative to the magnitudes summed into the logits, below which an f32
/// run is at a routing tie (`pleat_ir::interp::routing_margin`): 16 units of f32's roundoff. In
/// training, measured on tiny-moe at tsp=4, lr 0.1: the one step whose update was 10% off the
/// reference's had a gap of 2e-7; one other step, at 7e-7, is under the bound too (it matched),
/// and every other step's gap was above it.
pub const ROUTING_TIE_MARGIN: f64 = 16.0 * f32::EPSILON as f64 / 2.0;

/// The same for bf16 programs, and for f32 on a GPU: two units of bf16's roundoff, 2^-7. The
/// router reads a bf16 stream whose elements the run and the reference may round a last bit
/// apart, and more than one where the layers before it summed in another order. Measured on
/// tiny-moe at tp, tsp and cp of degree 2 and 4, dp×tsp and tp×cp, five seeds each: every token
/// whose logits were beyond the tolerance was at or after a row whose gap was under 1.5e-3. On a
/// Mixtral config of width 24 (two layers of 6 experts) at cp=2 and tp=2 a token 0.27 off followed
/// rows whose gaps were 4.2e-3 to 4.8e-3, beyond the 2^-8 this margin was; over 44 random bf16
/// mixtures 2^-7 left 65% of the tokens judged (2^-8: 77%). A GPU's f32 (its approximate
/// exponentials, cuBLAS's summation order) has not been measured; this wider margin stands for it.
pub const BF16_ROUTING_TIE_MARGIN: f64 = 1.0 / 128.0;

/// Whether any of `programs` stores a buffer in bf16 (`--precision bf16`).
fn stores_bf16(programs: &[Program]) -> bool {
    programs.iter().flat_map(|program| &program.buffers).any(|buffer| buffer.dtype == DType::Bf16)
}

/// The routing tie margin of a run: f32's on the CPU, bf16's for bf16 programs or on a GPU.
pub fn routing_tie_margin(bf16: bool, cuda: bool) -> f64 {
    if bf16 || cuda {
        BF16_ROUTING_TIE_MARGIN
    } else {
        ROUTING_TIE_MARGIN
    }
}

/// The reference's logits of a forward run, and which tokens a routing tie can reach.
pub struct ForwardReference {
    /// `[batch, seq, vocab]`, row-major.
    pub logits: Vec<f32>,
    /// For each token, in `[batch, seq]` order: whether a routing tie at it or before it can
    /// change its logits.
    at_tie: Vec<bool>,
}

/// A run's logits beside the reference's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogitsCheck {
    /// The largest absolute difference over the judged tokens (NaN if either side holds a NaN or
    /// their lengths differ); `None` when every token is at a routing tie.
    pub max_abs_err: Option<f32>,
    /// Tokens at a routing tie, reported, not judged.
    pub tie_tokens: usize,
    /// Their largest absolute difference (0 when there are none).
    pub tie_max_abs_err: f32,
    /// Tokens in all.
    pub tokens: usize,
}

impl LogitsCheck {
    /// The check's lines for people: the judged tokens' verdict against `tolerance`, and the
    /// tokens at a routing tie.
    pub fn describe(&self, tolerance: f32) -> Vec<String> {
        let mut lines = Vec::new();
        let judged = self.tokens - self.tie_tokens;
        match self.max_abs_err {
            Some(err) => {
                let verdict = if err <= tolerance { "ok" } else { "FAILED" };
                let over = if self.tie_tokens > 0 {
                    format!(" over {judged} of {} tokens", self.tokens)
                } else {
                    String::new()
                };
                lines.push(format!(
                    "check: max |logits - reference|{over} = {err:.3e} (tolerance {tolerance:.1e}): {verdict}"
                ));
            }
            None => lines.push(format!("check: all {} tokens are at a routing tie; none judged", self.tokens)),
        }
        if self.tie_tokens > 0 {
            lines.push(format!(
                "check: {} tokens at a routing tie (a router's top-k choice within rounding at or before them in their sequence) reported, not judged: max |logits - reference| = {:.3e}",
                self.tie_tokens, self.tie_max_abs_err
            ));
        }
        lines
    }

    /// The tokens at a routing tie, for JSON.
    pub fn ties_json(&self) -> serde_json::Value {
        serde_json::json!({
            "tokens": self.tie_tokens,
            "of_tokens": self.tokens,
            "max_abs_err": self.tie_max_abs_err,
        })
    }
}

impl ForwardReference {
    /// Compares `logits` (the run's, `[batch, seq, vocab]`) with the reference's, token by token.
    pub fn compare(&self, logits: &[f32]) -> LogitsCheck {
        let tokens = self.at_tie.len();
        if logits.len() != self.logits.len() || tokens == 0 || self.logits.len() % tokens != 0 {
            return LogitsCheck { max_abs_err: Some(f32::NAN), tie_tokens: 0, tie_max_abs_err: 0.0, tokens };
        }
        let vocab = self.logits.len() / tokens;
        let (mut judged, mut tie) = (None::<f32>, 0.0f32);
        let pairs = logits.chunks_exact(vocab).zip(self.logits.chunks_exact(vocab));
        for ((got, want), &at_tie) in pairs.zip(&self.at_tie) {
            let err = max_abs_diff(got, want);
            if at_tie {
                tie = nan_max(tie, err);
            } else {
                judged = Some(judged.map_or(err, |worst| nan_max(worst, err)));
            }
        }
        let tie_tokens = self.at_tie.iter().filter(|&&at_tie| at_tie).count();
        LogitsCheck { max_abs_err: judged, tie_tokens, tie_max_abs_err: tie, tokens }
    }
}

/// The logits' tolerance under bf16, as a share of the reference's largest logit: eight times
/// bf16's unit roundoff 2^-8. The logits come out of bf16 activations and weights (8 significant
/// bits each) through every layer, so they can be held to bf16's accuracy, not f32's.
pub const BF16_LOGITS_REL_TOL: f32 = 16.0 / 512.0;

/// The f32 logits' tolerance beyond `F32_TOL`, as a share of the reference's largest logit: 1e-5,
/// which is `F32_TOL` at a logit of 10. Logits are rarely larger, but weights scaled up make them
/// so, and f32's rounding grows with them (logits near 1e38 were 1.3e31 apart, 1e-7 of them).
pub const F32_LOGITS_REL_TOL: f32 = 1e-5;

/// The tolerance of a logits check: `F32_TOL`, or `F32_LOGITS_REL_TOL` (under bf16 programs
/// `BF16_LOGITS_REL_TOL`) of the reference's largest magnitude where that is more.
fn logits_tolerance(programs: &[Program], reference: &[f32]) -> f32 {
    let largest = reference.iter().fold(0.0f32, |largest, value| largest.max(value.abs()));
    let share = if stores_bf16(programs) { BF16_LOGITS_REL_TOL } else { F32_LOGITS_REL_TOL };
    F32_TOL.max(share * largest)
}

/// `--check` of a forward run's `logits`: the reference at the programs' precision, with the
/// routing tie margin of that precision (or of a GPU, with `cuda`), compared with them; and the
/// tolerance they are held to (at least `CUDA_F32_TOL` on a GPU).
pub fn check_logits(
    config: &ModelConfig,
    tokens: &Tokens,
    weights: &dyn WeightSource,
    programs: &[Program],
    logits: &[f32],
    cuda: bool,
) -> Result<(LogitsCheck, f32)> {
    let bf16 = stores_bf16(programs);
    let reference = forward_reference(config, tokens, weights, bf16, routing_tie_margin(bf16, cuda))?;
    // (A run's NaN beside a finite reference is a pleat bug; beside the reference's own, it is not.)
    if let Some(at) = reference.logits.iter().position(|value| !value.is_finite()) {
        let vocab = config.vocab_size as usize;
        let (row, entry) = (at / vocab, at % vocab);
        let seq = tokens.seq as usize;
        anyhow::bail!(crate::usage::UsageError::ReferenceNotFinite {
            value: reference.logits[at],
            sequence: row / seq,
            position: row % seq,
            entry,
        });
    }
    let tolerance = logits_tolerance(programs, &reference.logits);
    let tolerance = if cuda { tolerance.max(CUDA_F32_TOL) } else { tolerance };
    Ok((reference.compare(logits), tolerance))
}

/// [`check_logits`] where `check` (`--check`) asks for it, and the tolerance the logits are held
/// to (f32's where it does not).
pub fn check_logits_if(
    check: bool,
    (config, tokens, weights): (&ModelConfig, &Tokens, &dyn WeightSource),
    programs: &[Program],
    logits: &[f32],
    cuda: bool,
) -> Result<(Option<LogitsCheck>, f32)> {
    if !check {
        return Ok((None, crate::run::F32_TOL));
    }
    let (check, tolerance) = check_logits(config, tokens, weights, programs, logits, cuda)?;
    Ok((Some(check), tolerance))
}

/// The reference's forward run of `config` on `tokens` with `weights`, at bf16 when `bf16` (the
/// programs store bf16), each token marked at a routing tie under `tie_margin`.
pub fn forward_reference(
    config: &ModelConfig,
    tokens: &Tokens,
    weights: &dyn WeightSource,
    bf16: bool,
    tie_margin: f64,
) -> Result<ForwardReference> {
    let config = ModelConfig { dtype: if bf16 { ConfigDtype::Bf16 } else { ConfigDtype::F32 }, ..config.clone() };
    let module = pleat_ir::model::build(&config, tokens.batch, tokens.seq)?;
    let graph = &module.graph;
    let mut params = std::collections::HashMap::new();
    for (_, name) in graph.params() {
        let value = graph.find(name).expect("a param's node carries its name");
        let shape = graph.value(value).ty.shape.sizes();
        let region: Vec<(u64, u64)> = shape.iter().map(|&size| (0, size)).collect();
        params.insert(name.to_string(), weights.read(name, &shape, &region)?);
    }
    let lookup = |name: &str, _shape: &[u64]| params.get(name).cloned();
    let positions: Vec<u32> = (0..tokens.seq as u32).collect();
    let inputs = Inputs { tokens: &tokens.ids, positions: &positions, params: &lookup };
    let (batch, seq) = (tokens.batch as usize, tokens.seq as usize);
    let mixtures = mixtures(graph);
    if mixtures.is_empty() {
        // Without a mixture every value but the logits is dropped as soon as it is read.
        let logits = run_as_stored(graph, &inputs)?.remove(0).data;
        return Ok(ForwardReference { logits, at_tie: vec![false; batch * seq] });
    }
    let values = run_all_as_stored(graph, &inputs)?;
    let mut at_tie = vec![false; batch * seq];
    for mixture in mixtures {
        let (Some(x), Some(router)) = (values.get(mixture.x), values.get(mixture.router)) else { continue };
        let margins = routing_margins(x, router, mixture.top_k)?;
        mark_ties(&mut at_tie, &margins, seq, tie_margin, mixture.attention_after);
    }
    let output = graph.outputs()[0];
    let logits = values.get(output).map(|logits| logits.data.clone()).expect("the reference computed its outputs");
    Ok(ForwardReference { logits, at_tie })
}

/// Marks in `at_tie` (a token each, `[batch, seq]`) every token one mixture's routing tie can
/// reach: each row whose gap in `margins` (a row each) is under `tie_margin`, and with
/// `attention_after` (whether an attention follows the mixture, and whether every one that does is
/// causal) the later tokens of its sequence, or all of them.
fn mark_ties(at_tie: &mut [bool], margins: &[f64], seq: usize, tie_margin: f64, attention_after: Option<bool>) {
    for (row, _) in margins.iter().enumerate().filter(|&(_, &margin)| margin < tie_margin) {
        let (sequence, position) = (row / seq, row % seq);
        let reached = match attention_after {
            None => position..position + 1,
            Some(true) => position..seq,
            Some(false) => 0..seq,
        };
        at_tie[sequence * seq..][reached].iter_mut().for_each(|tie| *tie = true);
    }
}

/// A mixture of experts in the reference's graph.
struct Mixture {
    /// Its input stream `[batch, seq, hidden]` and router `[experts, hidden]`.
    x: pleat_ir::ValueId,
    router: pleat_ir::ValueId,
    top_k: u64,
    /// Whether an attention follows it: `Some(true)` when every attention that does is causal,
    /// `Some(false)` when one is not, `None` when none does.
    attention_after: Option<bool>,
}

/// Every mixture of experts of `graph`, in program order.
fn mixtures(graph: &Graph) -> Vec<Mixture> {
    let order = graph.order();
    order
        .iter()
        .enumerate()
        .filter_map(|(at, &node)| {
            let data = graph.node(node);
            let Op::MoeMlp { top_k, .. } = data.op else { return None };
            let attention_after =
                order[at + 1..].iter().fold(None, |after: Option<bool>, &later| match graph.node(later).op {
                    Op::Attention { causal } => Some(after.unwrap_or(true) && causal),
                    _ => after,
                });
            Some(Mixture { x: data.inputs[0], router: data.inputs[1], top_k, attention_after })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tie_reaches_the_later_tokens_of_its_sequence_through_a_causal_attention() {
        // Two sequences of four tokens; rows 1 and 6 (sequence 0 position 1, sequence 1 position
        // 2) are within the margin, row 3 exactly at it (not under).
        let margins = [1.0, 1e-4, 1.0, 1e-3, 1.0, 1.0, 0.0, 1.0];
        let marked = |attention_after| {
            let mut at_tie = vec![false; 8];
            mark_ties(&mut at_tie, &margins, 4, 1e-3, attention_after);
            at_tie.iter().map(|&tie| u8::from(tie)).collect::<Vec<_>>()
        };
        assert_eq!(marked(Some(true)), [0, 1, 1, 1, 0, 0, 1, 1]);
        assert_eq!(marked(None), [0, 1, 0, 0, 0, 0, 1, 0]);
        assert_eq!(marked(Some(false)), [1, 1, 1, 1, 1, 1, 1, 1]);
    }

    #[test]
    fn tokens_at_a_tie_are_reported_apart_from_the_judged_ones() {
        // Three tokens of two logits; the second is at a tie and 0.5 off, the others 0.25 and 0.
        let reference =
            ForwardReference { logits: vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], at_tie: vec![false, true, false] };
        let check = reference.compare(&[1.25, 2.0, 3.5, 4.0, 5.0, 6.0]);
        assert_eq!(check, LogitsCheck { max_abs_err: Some(0.25), tie_tokens: 1, tie_max_abs_err: 0.5, tokens: 3 });
        assert!(check.describe(0.1)[0].ends_with("FAILED"), "{:?}", check.describe(0.1));
        assert!(check.describe(0.1)[0].contains("over 2 of 3 tokens"));
        // A NaN among the judged tokens fails; a length mismatch is NaN.
        assert!(reference.compare(&[f32::NAN, 2.0, 3.0, 4.0, 5.0, 6.0]).max_abs_err.is_some_and(f32::is_nan));
        assert!(reference.compare(&[1.0]).max_abs_err.is_some_and(f32::is_nan));
        // Every token at a tie: nothing judged, and the check says so.
        let all = ForwardReference { at_tie: vec![true; 3], ..reference };
        let check = all.compare(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.5]);
        assert_eq!((check.max_abs_err, check.tie_tokens, check.tie_max_abs_err), (None, 3, 0.5));
        assert_eq!(check.describe(0.1)[0], "check: all 3 tokens are at a routing tie; none judged");
    }
}

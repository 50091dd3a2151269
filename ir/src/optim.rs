//! The reference AdamW optimizer: what a training step does to the weights once the gradients are
//! known, written plainly so that sharded optimizers (ZeRO-style, one shard of the state a rank)
//! can be checked against it.
//!
//! It follows `torch.optim.AdamW` (no amsgrad) step for step: decoupled weight decay
//! `w *= 1 - lr * weight_decay`, then `m = b1 m + (1 - b1) g`, `v = b2 v + (1 - b2) g^2`, and
//! `w -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`. Before it, the gradients may be
//! clipped to a global L2 norm as `torch.nn.utils.clip_grad_norm_` does: every gradient is scaled
//! by `min(1, max_norm / (norm + 1e-6))`. Master weights and both moments are f32; the arithmetic of
//! each element is f64, rounded once into the f32 state.
//!
//! Memory a parameter costs in mixed-precision training (`bytes_per_param`): the f32 master weight
//! and the two f32 moments are 12 bytes of optimizer state; with bf16 weights and bf16 gradients
//! that is 16 bytes (the ZeRO paper's count), with bf16 weights and f32 gradient accumulation
//! (Megatron-LM's `main_grad`) 18 bytes.

use crate::DType;

/// Bytes of optimizer state a parameter holds: f32 master weight, f32 first and second moments.
pub const OPTIMIZER_STATE_BYTES: u64 = 12;

/// The bytes one parameter costs in training: its weight in `param`, its gradient in `grad`, and
/// the optimizer state (`bytes_per_param(Bf16, Bf16)` = 16, `bytes_per_param(Bf16, F32)` = 18).
pub fn bytes_per_param(param: DType, grad: DType) -> u64 {
    param.size_bytes() + grad.size_bytes() + OPTIMIZER_STATE_BYTES
}

/// AdamW's hyperparameters.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamWConfig {
    /// The step size `lr`.
    pub learning_rate: f64,
    /// The first moment's decay `b1`.
    pub beta1: f64,
    /// The second moment's decay `b2`.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// The decoupled weight decay.
    pub weight_decay: f64,
    /// Clip the gradients to this global L2 norm first; `None` leaves them as they are.
    pub max_grad_norm: Option<f64>,
}

impl Default for AdamWConfig {
    /// PyTorch's defaults (lr 1e-3, betas 0.9 and 0.999, eps 1e-8, weight decay 0.01) with Hugging
    /// Face Trainer's clipping to norm 1.
    fn default() -> Self {
        AdamWConfig {
            learning_rate: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            max_grad_norm: Some(1.0),
        }
    }
}

/// One parameter's optimizer state.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamState {
    /// The f32 master weights.
    pub master: Vec<f32>,
    /// The first moment `m`.
    pub exp_avg: Vec<f32>,
    /// The second moment `v`.
    pub exp_avg_sq: Vec<f32>,
}

/// What one step saw.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// The global L2 norm of the gradients before clipping.
    pub grad_norm: f64,
    /// The factor the gradients were scaled by (1 without clipping).
    pub clip_scale: f64,
}

/// Why a step was refused (the state is then unchanged).
#[derive(Clone, Debug, PartialEq, thiserror::Error, miette::Diagnostic)]
pub enum OptimError {
    /// A gradient list of the wrong length.
    #[error("got {got} gradients for {expected} parameters; pass one gradient a parameter, in order")]
    #[diagnostic(code(E0440), help("pass one gradient a parameter, in order"))]
    GradientCount {
        /// The parameters.
        expected: usize,
        /// The gradients given.
        got: usize,
    },
    /// A gradient of the wrong size.
    #[error("gradient {index} has {got} elements but its parameter has {expected}; pass gradients in parameter order")]
    #[diagnostic(code(E0441), help("pass gradients in parameter order"))]
    GradientLength {
        /// The parameter's position.
        index: usize,
        /// The parameter's elements.
        expected: usize,
        /// The gradient's elements.
        got: usize,
    },
    /// A gradient norm that is NaN or infinite: the step would destroy the weights.
    #[error("the gradient norm is {norm}; skip this step or lower the learning rate (a loss scale overflowed)")]
    #[diagnostic(code(E0442), help("skip the step or lower the learning rate"))]
    NonFinite {
        /// The norm.
        norm: f64,
    },
}

/// AdamW over a list of parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamW {
    /// The hyperparameters.
    pub config: AdamWConfig,
    /// The steps taken.
    pub step: u64,
    /// One state a parameter, in the order the gradients come.
    pub params: Vec<ParamState>,
}

impl AdamW {
    /// An optimizer whose master weights are `weights` and whose moments are zero.
    pub fn new(config: AdamWConfig, weights: &[&[f32]]) -> AdamW {
        let params = weights
            .iter()
            .map(|weights| ParamState {
                master: weights.to_vec(),
                exp_avg: vec![0.0; weights.len()],
                exp_avg_sq: vec![0.0; weights.len()],
            })
            .collect();
        AdamW { config, step: 0, params }
    }

    /// Takes one step with `grads` (one a parameter, in order), clipping them first when configured.
    pub fn step(&mut self, grads: &[&[f32]]) -> Result<StepReport, OptimError> {
        if grads.len() != self.params.len() {
            return Err(OptimError::GradientCount { expected: self.params.len(), got: grads.len() });
        }
        for (index, (grad, param)) in grads.iter().zip(&self.params).enumerate() {
            if grad.len() != param.master.len() {
                return Err(OptimError::GradientLength { index, expected: param.master.len(), got: grad.len() });
            }
        }
        let grad_norm = global_norm(grads);
        if !grad_norm.is_finite() {
            return Err(OptimError::NonFinite { norm: grad_norm });
        }
        let clip_scale = match self.config.max_grad_norm {
            Some(max_norm) => (max_norm / (grad_norm + 1e-6)).min(1.0),
            None => 1.0,
        };
        self.step += 1;
        let AdamWConfig { learning_rate, beta1, beta2, eps, weight_decay, .. } = self.config;
        let exponent = i32::try_from(self.step).unwrap_or(i32::MAX);
        let step_size = learning_rate / (1.0 - beta1.powi(exponent));
        let bias_correction2_sqrt = (1.0 - beta2.powi(exponent)).sqrt();
        for (param, grad) in self.params.iter_mut().zip(grads) {
            for index in 0..grad.len() {
                let g = f64::from(grad[index]) * clip_scale;
                let m = beta1 * f64::from(param.exp_avg[index]) + (1.0 - beta1) * g;
                let v = beta2 * f64::from(param.exp_avg_sq[index]) + (1.0 - beta2) * g * g;
                param.exp_avg[index] = m as f32;
                param.exp_avg_sq[index] = v as f32;
                let decayed = f64::from(param.master[index]) * (1.0 - learning_rate * weight_decay);
                let denominator = f64::from(v as f32).sqrt() / bias_correction2_sqrt + eps;
                param.master[index] = (decayed - step_size * f64::from(m as f32) / denominator) as f32;
            }
        }
        Ok(StepReport { grad_norm, clip_scale })
    }
}

/// The L2 norm of all gradients together, in f64.
pub fn global_norm(grads: &[&[f32]]) -> f64 {
    grads.iter().flat_map(|grad| grad.iter()).map(|&g| f64::from(g) * f64::from(g)).sum::<f64>().sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(max_grad_norm: Option<f64>) -> AdamWConfig {
        AdamWConfig { learning_rate: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, max_grad_norm }
    }

    #[track_caller]
    fn close(got: f32, want: f64) {
        assert!((f64::from(got) - want).abs() <= 1e-6 * want.abs().max(1.0), "got {got}, want {want}");
    }

    #[test]
    fn two_steps_by_hand() {
        // lr 0.1, betas 0.9 / 0.999, eps 1e-8, weight decay 0.01; w = 1, g1 = 0.5, g2 = -0.25.
        // Step 1: decay w = 1 * (1 - 0.001) = 0.999; m = 0.05; v = 0.001 * 0.25 = 0.00025;
        //   bias corrections 1 - 0.9 = 0.1 and 1 - 0.999 = 0.001; denominator
        //   sqrt(0.00025) / sqrt(0.001) + 1e-8 = 0.5 + 1e-8; update 0.1 / 0.1 * 0.05 / 0.50000001
        //   = 0.099999998; w = 0.899000002.
        // Step 2: decay w = 0.899000002 * 0.999 = 0.898101002; m = 0.045 - 0.025 = 0.02;
        //   v = 0.00024975 + 0.0000625 = 0.00031225; corrections 1 - 0.81 = 0.19 and
        //   1 - 0.998001 = 0.001999; denominator sqrt(0.00031225 / 0.001999) + 1e-8 = 0.39522539;
        //   update 0.1 / 0.19 * 0.02 / 0.39522539 = 0.026633703; w = 0.871467299.
        let mut optimizer = AdamW::new(config(None), &[&[1.0]]);
        let report = optimizer.step(&[&[0.5]]).unwrap();
        assert_eq!(report, StepReport { grad_norm: 0.5, clip_scale: 1.0 });
        close(optimizer.params[0].master[0], 0.899_000_002);
        close(optimizer.params[0].exp_avg[0], 0.05);
        close(optimizer.params[0].exp_avg_sq[0], 0.000_25);
        optimizer.step(&[&[-0.25]]).unwrap();
        assert_eq!(optimizer.step, 2);
        close(optimizer.params[0].master[0], 0.871_467_299);
        close(optimizer.params[0].exp_avg[0], 0.02);
        close(optimizer.params[0].exp_avg_sq[0], 0.000_312_25);
    }

    #[test]
    fn clipping_scales_every_gradient_by_the_global_norm() {
        // Gradients [3] and [4] of two parameters: global norm 5; max 1 scales by 1 / (5 + 1e-6),
        // so the first moments are 0.1 * [0.6, 0.8].
        let mut optimizer = AdamW::new(config(Some(1.0)), &[&[0.0], &[0.0]]);
        let report = optimizer.step(&[&[3.0], &[4.0]]).unwrap();
        assert_eq!(report.grad_norm, 5.0);
        assert!((report.clip_scale - 1.0 / (5.0 + 1e-6)).abs() < 1e-15);
        close(optimizer.params[0].exp_avg[0], 0.06);
        close(optimizer.params[1].exp_avg[0], 0.08);
        // A norm below the limit leaves the gradients alone.
        let mut optimizer = AdamW::new(config(Some(10.0)), &[&[0.0]]);
        assert_eq!(optimizer.step(&[&[3.0]]).unwrap().clip_scale, 1.0);
    }

    #[test]
    fn bad_gradients_are_refused_without_a_step() {
        let mut optimizer = AdamW::new(config(None), &[&[1.0, 2.0]]);
        let before = optimizer.clone();
        assert_eq!(optimizer.step(&[]), Err(OptimError::GradientCount { expected: 1, got: 0 }));
        assert_eq!(optimizer.step(&[&[1.0]]), Err(OptimError::GradientLength { index: 0, expected: 2, got: 1 }));
        assert!(matches!(optimizer.step(&[&[f32::NAN, 1.0]]), Err(OptimError::NonFinite { .. })));
        assert_eq!(optimizer, before);
    }

    #[test]
    fn bytes_per_param_counts_weights_gradients_and_state() {
        assert_eq!(bytes_per_param(DType::Bf16, DType::Bf16), 16);
        assert_eq!(bytes_per_param(DType::Bf16, DType::F32), 18);
        assert_eq!(bytes_per_param(DType::F32, DType::F32), 20);
    }
}

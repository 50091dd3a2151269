//! The runtime's loss and backward kernels agree with the reference interpreter end to end: the
//! `tiny` training graph, differentiated by `pleat_passes::autodiff`, lowered for one rank and run on
//! the threads runtime gives the interpreter's loss and every parameter gradient; and so does a tied
//! Qwen2 variant with biases.

use std::time::{Duration, Instant};

use pleat_ir::interp::{run, Inputs};
use pleat_ir::model::config::{Architecture, ModelConfig};
use pleat_ir::model::preset::preset;
use pleat_ir::model::stream::synthetic_tokens;
use pleat_passes::autodiff::differentiate;
use pleat_runtime::weights::{SeededWeights, WeightSource};
use pleat_runtime::{assemble, run_on_threads, RunInputs};

#[test]
fn tiny_training_step_matches_the_interpreter() {
    let kernels = check(&preset("tiny").expect("tiny exists"), 2, 16);
    for kernel in BACKWARD_KERNELS {
        assert!(kernels.contains(&kernel.to_string()), "the program runs no {kernel}: {kernels:?}");
    }
}

/// Every backward kernel but `sum_leading` (biases), which Llama's graph does not need.
const BACKWARD_KERNELS: [&str; 12] = [
    "cross_entropy",
    "cross_entropy_grad",
    "matmul_grad_input",
    "matmul_grad_weight",
    "rms_norm_grad_input",
    "rms_norm_grad_weight",
    "rope_grad",
    "attention_grad_query",
    "attention_grad_key",
    "attention_grad_value",
    "silu_mul_grad_gate",
    "embedding_grad",
];

/// Qwen2's q/k/v biases (their gradients are `sum_leading`) and tied embeddings (the table's
/// gradient sums the embedding's and the LM head's).
#[test]
fn tied_qwen2_with_biases_matches_the_interpreter() {
    let mut config = preset("tiny").expect("tiny exists");
    config.architecture = Architecture::Qwen2;
    config.attention_bias = true;
    config.tie_word_embeddings = true;
    let kernels = check(&config, 3, 8);
    assert!(kernels.contains(&"sum_leading".to_string()), "the bias gradients: {kernels:?}");
}

/// Runs one training step of `config` on `batch` sequences of `seq` tokens in the interpreter and on
/// the threads runtime (one rank), and compares the loss and every gradient; returns the names of the
/// kernels the program ran, as its text form spells them.
fn check(config: &ModelConfig, batch: u64, seq: u64) -> Vec<String> {
    let mut module = pleat_ir::model::build_training(config, batch, seq).expect("builds");
    let loss = module.graph.outputs()[0];
    let gradients = differentiate(&mut module.graph, loss).expect("differentiates");
    pleat_passes::verify(&module).unwrap_or_else(|errors| panic!("{errors}"));
    assert!(!gradients.params.is_empty());

    let weights = SeededWeights::new(17);
    let tokens = synthetic_tokens(3, 0, batch, seq, config.vocab_size);
    let positions: Vec<u32> = (0..seq as u32).collect();
    let lookup = |name: &str, shape: &[u64]| {
        let region: Vec<(u64, u64)> = shape.iter().map(|&size| (0, size)).collect();
        weights.read(name, shape, &region).ok()
    };
    let expected = run(&module.graph, &Inputs { tokens: &tokens, positions: &positions, params: &lookup })
        .expect("the interpreter runs the training graph");

    let programs = pleat_backend::lower(&module).expect("lowers the training graph");
    assert_eq!(programs.len(), 1);
    for program in &programs {
        pleat_backend::validate::validate(program).expect("a consistent program");
    }
    let inputs = RunInputs { tokens: &tokens, positions: &positions, weights: &weights, epoch: Instant::now() };
    let outcomes = run_on_threads(&programs, &inputs, Duration::from_secs(60)).expect("the runtime runs it");

    let outputs = module.graph.outputs().to_vec();
    assert_eq!(outputs.len(), expected.len());
    let mut checked = 0;
    for (index, (&value, want)) in outputs.iter().zip(&expected).enumerate() {
        let name = &module.graph.def(value).name;
        let (shape, got) = assemble(&outcomes, index as u32).unwrap_or_else(|| panic!("output {index} ({name})"));
        let want_shape: Vec<u64> = want.shape.iter().map(|&size| size as u64).collect();
        assert_eq!(shape, want_shape, "{name}: shape");
        let norm = want.data.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt();
        let worst = got.iter().zip(&want.data).map(|(&a, &b)| f64::from(a - b).abs()).fold(0.0, f64::max);
        assert!(norm > 0.0, "{name}: an all-zero reference checks nothing");
        assert!(worst <= 1e-5 * norm, "{name}: max abs error {worst:e} exceeds 1e-5 of the norm {norm:e}");
        if index == 0 {
            assert_eq!(name, "loss");
        } else {
            assert!(name.starts_with("grad."), "output {index} is {name}");
        }
        checked += 1;
    }
    assert_eq!(checked, 1 + gradients.params.len());
    let text = pleat_backend::text::print_program(&programs[0]);
    // Kernel lines read `b7 = name key=value..(operands)`.
    text.lines()
        .filter_map(|line| line.split_once(" = ").map(|(_, rest)| rest))
        .filter_map(|rest| rest.split([' ', '(']).next())
        .map(str::to_string)
        .collect()
}

//! Context parallelism (ring attention on the `cp` axis): every plan gives the reference
//! interpreter's logits, alone and with dp and tp; the forward send volume a layer a rank is exactly
//! what the K/V ring moves; bad meshes and sequences are clear errors.

mod common;

use common::check_equivalence;
use pleat_ir::model::config::ModelConfig;
use pleat_ir::model::preset::preset;
use pleat_ir::Mesh;
use pleat_passes::{run_pipeline, PassCtx, SHARD_PIPELINE};
use pleat_runtime::comm::CollectiveKind;
use pleat_runtime::weights::SeededWeights;

fn tiny() -> ModelConfig {
    preset("tiny").expect("tiny preset")
}

#[test]
fn context_parallel_matches_reference_at_every_degree() {
    // seq 16 splits into 2·cp zigzag chunks for cp = 1, 2, 4.
    for cp in [1, 2, 4] {
        check_equivalence(&tiny(), 2, 16, &format!("cp={cp}"));
    }
}

#[test]
fn context_parallel_composes_with_data_and_tensor_parallelism() {
    check_equivalence(&tiny(), 4, 16, "dp=2,cp=2");
    check_equivalence(&tiny(), 2, 16, "tp=2,cp=2");
    check_equivalence(&tiny(), 2, 16, "cp=2,tp=2");
    check_equivalence(&tiny(), 4, 16, "dp=2,tp=2,cp=2");
}

#[test]
fn context_parallel_with_uneven_gqa_and_tied_embeddings_matches_reference() {
    // tp=4 outnumbers the 2 kv heads: k/v stay whole on every tp rank while they ring over cp.
    let mut config = tiny();
    config.num_kv_heads = 2;
    config.tie_word_embeddings = true;
    check_equivalence(&config, 2, 32, "tp=4,cp=2");
    check_equivalence(&config, 2, 32, "cp=4");
}

/// Bytes rank `rank` sent point to point: two-layer model minus one-layer model, so one layer's.
fn layer_send_bytes(mesh: &str, batch: u64, seq: u64) -> Vec<u64> {
    let sent = |layers| {
        let mut config = tiny();
        config.num_layers = layers;
        let (_, programs) = common::compile(&config, batch, seq, mesh);
        let tokens = common::tokens(batch, seq, config.vocab_size);
        let (_, outcomes) = common::run(&programs, &tokens, seq, &SeededWeights::new(3));
        outcomes.iter().map(|outcome| outcome.comm.bytes(CollectiveKind::SendRecv)).collect::<Vec<u64>>()
    };
    sent(2).iter().zip(sent(1)).map(|(two, one)| two - one).collect()
}

#[test]
fn forward_volume_a_layer_a_rank_is_the_kv_ring() {
    // Each of the D-1 hops sends one block: k and v of the rank's S/D tokens for its kv heads, and
    // their S/D positions (4 bytes each, f32 values and u32 positions alike). So a layer a rank
    // sends 4·(D-1)/D·(2·B·S·h_kv + S) bytes, h_kv = kv_heads·head_dim held locally: DESIGN §4's
    // 2(D-1)/D·BSh_kv for K and V, plus (D-1)/D·S for the positions that travel with them.
    let config = tiny();
    let (kv_heads, head_dim) = (config.num_kv_heads, config.head_dim);
    let (batch, seq) = (2u64, 32u64);
    for (mesh, degree, local_batch, local_kv_heads) in [
        ("cp=2", 2u64, batch, kv_heads),
        ("cp=4", 4, batch, kv_heads),
        ("dp=2,cp=2", 2, batch / 2, kv_heads),
        ("tp=2,cp=2", 2, batch, kv_heads / 2),
    ] {
        let h_kv = local_kv_heads * head_dim;
        let want = 4 * (degree - 1) * (2 * local_batch * seq * h_kv + seq) / degree;
        for (rank, got) in layer_send_bytes(mesh, batch, seq).into_iter().enumerate() {
            assert_eq!(got, want, "{mesh} rank {rank}");
        }
    }
}

fn fold_error(mesh: &str, seq: u64) -> String {
    let mut module = pleat_ir::model::build(&tiny(), 2, seq).expect("build");
    module.mesh = Mesh::parse(mesh).expect("mesh");
    run_pipeline(SHARD_PIPELINE, &mut module, &PassCtx::default()).expect_err("refused").to_string()
}

#[test]
fn bad_sequences_and_meshes_are_clear_errors() {
    assert_eq!(
        fold_error("cp=4", 20),
        "seq=20 does not split into 2xcp=8 zigzag chunks; use a --seq that is a multiple of 8 (e.g. 24), or cp in {1,2,5,10}"
    );
    assert_eq!(
        fold_error("dp=2,tsp=2,cp=2", 16),
        "mesh axes tsp and cp cannot be combined: both split the sequence; use one of them"
    );
}

#[test]
fn programs_pass_the_static_matcher_and_validate() {
    for mesh in ["cp=2", "cp=4", "dp=2,tp=2,cp=2"] {
        let (_, programs) = common::compile(&tiny(), 4, 16, mesh);
        for program in &programs {
            pleat_backend::validate::validate(program).unwrap_or_else(|err| panic!("{mesh}: {err}"));
            let text = pleat_backend::text::print_program(program);
            // D-1 hops a layer, one merge per hop: the rank's own block sent, D-2 blocks received
            // and passed on (relays), the last one only received.
            let degree = Mesh::parse(mesh).unwrap().axis(pleat_ir::AxisName::Cp).unwrap().size as usize;
            let layers = tiny().num_layers as usize;
            let lines = |pattern: &str| text.lines().filter(|line| line.contains(pattern)).count();
            assert_eq!(text.matches("merge_attention").count(), layers * (degree - 1), "{mesh}");
            assert_eq!(lines("send("), layers, "{mesh}");
            assert_eq!(lines(" = relay from rank "), layers * (degree - 2), "{mesh}");
            assert_eq!(lines(" = recv from rank "), layers, "{mesh}");
        }
    }
}

#[test]
fn memory_planner_peak_equals_the_executors_measurement() {
    let config = tiny();
    let (batch, seq) = (2, 8);
    let ids = common::tokens(batch, seq, config.vocab_size);
    for mesh in ["cp=2", "cp=4", "tp=2,cp=2"] {
        let (_, programs) = common::compile(&config, batch, seq, mesh);
        let (_, outcomes) = common::run(&programs, &ids, seq, &SeededWeights::new(3));
        for (program, outcome) in programs.iter().zip(&outcomes) {
            let planned = pleat_backend::memory::plan(program, pleat_backend::memory::ElementSize::Fixed(4));
            assert_eq!(planned.peak_bytes, outcome.peak_bytes, "{mesh} rank {}", program.rank);
        }
    }
}

#[path = "support/cli.rs"]
mod cli;

#[test]
fn the_cli_runs_and_checks_cp_meshes() {
    for (mesh, strategy) in [("cp=2", "cp"), ("dp=2,tp=2,cp=2", "auto")] {
        let report = cli::json_of(&[
            "run",
            "tiny",
            "--mesh",
            mesh,
            "--strategy",
            strategy,
            "--batch",
            "2",
            "--seq",
            "16",
            "--check",
            "--format",
            "json",
        ]);
        assert!(report["max_abs_err"].as_f64().expect("a number") < 1e-4, "{mesh}: {report}");
        assert!(report["comm_bytes"]["send"].as_u64().expect("bytes") > 0, "{mesh}: {report}");
    }
    let message = cli::error_of(&["run", "tiny", "--mesh", "tp=2", "--strategy", "cp"]);
    assert!(message.contains("--strategy cp needs the cp axis in --mesh"), "{message}");
}

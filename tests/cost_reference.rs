//! The cost model against published figures: Megatron-LM's `theoretical_memory_usage.py` and
//! Korthikanti et al.'s Table 2 on three published configurations (to the byte, each worked out
//! by hand below), and the TSP paper's memory figures for its 7B model on 8 MI300X.

use pleat_ir::model::preset::preset;
use pleat_ir::AxisName;
use pleat_passes::cost::activation::layer_activations;
use pleat_passes::cost::megatron::{korthikanti_layer, theoretical_memory, MegatronArgs, Table2Row};
use pleat_passes::cost::memory::memory_per_stage;
use pleat_passes::cost::{estimate, HardwareSpec, Layout, ModelShape, Recompute, Workload};

/// Asserts two byte counts agree to the byte.
#[track_caller]
fn same_bytes(label: &str, got: f64, want: f64) {
    assert!((got - want).abs() < 1.0, "{label}: got {got}, want {want} (diff {})", got - want);
}

// === GPT-3 175B, TP=8, PP=8, SP, selective recompute (Korthikanti et al. 2022, Table 3) ===

fn gpt3_args() -> MegatronArgs {
    MegatronArgs {
        num_layers: 96,
        hidden_size: 12288,
        ffn_hidden_size: 49152,
        num_attention_heads: 96,
        num_query_groups: 96,
        kv_channels: 128,
        swiglu: false,
        rms_norm: false,
        padded_vocab_size: 51200,
        untie_embeddings_and_output_weights: false,
        seq_length: 2048,
        micro_batch_size: 1,
        tensor_model_parallel_size: 8,
        pipeline_model_parallel_size: 8,
        virtual_pipeline_model_parallel_size: None,
        data_parallel_size: 1,
        use_distributed_optimizer: false,
        sequence_parallel: true,
        selective_recompute: true,
    }
}

fn gpt3_shape() -> ModelShape {
    ModelShape::gpt("gpt3-175b", 51200, 12288, 96, 96)
}

#[test]
fn gpt3_175b_megatron_by_hand() {
    // Weights: attention 4h² = 603,979,776; a layer 2h(f + 2) + 4h² = 1,811,988,480; the block
    // 96 layers + the final LayerNorm 2h = 173,950,918,656; the first stage's shard
    // (block/8 + embedding 12288·51200)/8 = 2,796,626,304 parameters, 18 bytes each.
    let memory = theoretical_memory(&gpt3_args(), Some(64));
    same_bytes("weights", memory.weight_and_optimizer_bytes, 2_796_626_304.0 * 18.0);
    assert_eq!(2_796_626_304u64 * 18, 50_339_273_472);
    // Activations: sbh(18 + 4f/h) = 25,165,824·34 = 855,638,016 a layer; 96 layers; + 8sbp
    // (131,072) + sbhp (201,326,592); the 1F1B factor min(1, 64/8) = 1; over t = 8.
    same_bytes("activations", memory.activation_bytes, 10_292_838_400.0);
    assert_eq!((855_638_016u64 * 96 + 131_072 + 201_326_592) / 8, 10_292_838_400);
    // Korthikanti's Table 2 row for this setting is the same per-layer term.
    let row = korthikanti_layer(Table2Row::TensorSequenceParallelSelective, 2048.0, 1.0, 12288.0, 96.0, 8.0);
    same_bytes("table 2", row, 855_638_016.0 / 8.0);
}

#[test]
fn gpt3_175b_general_model_equals_megatron_up_to_named_terms() {
    let layout = Layout::new(&[(AxisName::Pp, 8), (AxisName::Tp, 8)], true);
    let workload = Workload {
        micro_batches: 64,
        recompute: Recompute::Selective,
        flash_attention: false,
        ..Workload::training(2048, 1)
    };
    let stage = &memory_per_stage(&gpt3_shape(), &layout, &workload)[0];
    let megatron = theoretical_memory(&gpt3_args(), Some(64));
    let h = 12288.0;
    // Megatron divides every norm by tp and spreads the final norm over the stages; LayerNorm
    // weights are in fact whole on every tp rank, and the final norm sits on the last stage.
    let norms_whole_on_tp = 12.0 * 4.0 * h * (1.0 - 1.0 / 8.0);
    let final_norm_spread = 2.0 * h / 64.0;
    same_bytes(
        "static",
        stage.static_bytes(),
        megatron.weight_and_optimizer_bytes + 18.0 * (norms_whole_on_tp - final_norm_spread),
    );
    // Activations: the same 34sbh/t a layer, 12 layers, 8 micro-batches in flight. Megatron adds the
    // embedding's dropout mask (sbh·p/t) and counts token ids as int64 over tp (8sbp/t); pleat
    // keeps int32 ids whole (4sb a micro-batch) and has no embedding dropout.
    let (s, p, t) = (2048.0, 8.0, 8.0);
    let embedding_dropout = s * h * p / t;
    let token_ids = 8.0 * s * p / t - 4.0 * s * p;
    same_bytes("activations", stage.activations_bytes, megatron.activation_bytes - embedding_dropout - token_ids);
    assert_eq!(stage.in_flight, 8.0);
}

// === Llama-2-7B, TP=8, no SP, no recompute ===

fn llama2_args() -> MegatronArgs {
    MegatronArgs {
        num_layers: 32,
        hidden_size: 4096,
        ffn_hidden_size: 11008,
        num_attention_heads: 32,
        num_query_groups: 32,
        kv_channels: 128,
        swiglu: true,
        rms_norm: true,
        padded_vocab_size: 32000,
        untie_embeddings_and_output_weights: true,
        seq_length: 4096,
        micro_batch_size: 1,
        tensor_model_parallel_size: 8,
        pipeline_model_parallel_size: 1,
        virtual_pipeline_model_parallel_size: None,
        data_parallel_size: 1,
        use_distributed_optimizer: false,
        sequence_parallel: false,
        selective_recompute: false,
    }
}

#[test]
fn llama2_7b_megatron_by_hand() {
    // A layer: 2h(1.5f + 1) + 4h² = 8192·16513 + 67,108,864 = 202,383,360; the block 32 layers + h
    // = 6,476,271,616; plus embedding and untied output 2·131,072,000: 6,738,415,616 parameters (the
    // published count), over tp = 8: 842,301,952, at 18 bytes.
    let memory = theoretical_memory(&llama2_args(), None);
    same_bytes("weights", memory.weight_and_optimizer_bytes, 842_301_952.0 * 18.0);
    assert_eq!(6_738_415_616u64 / 8, 842_301_952);
    // Activations without SP: sbh(10 + 24/8) = 16,777,216·13 = 218,103,808 a layer, 32 layers;
    // + 8sbp 32,768 + sbhp 16,777,216; + (logits s·V/t 16,384,000 + sbh 16,777,216)·2; ·1.05.
    let by_hand = (218_103_808u64 * 32 + 32_768 + 16_777_216 + (16_384_000 + 16_777_216) * 2) as f64 * 1.05;
    same_bytes("activations", memory.activation_bytes, by_hand);
    same_bytes("by hand", by_hand, 7_415_576_985.6);
}

#[test]
fn llama2_7b_general_model_per_layer_differs_by_named_terms() {
    let model = ModelShape::from_config(&preset("llama2-7b").unwrap());
    let layout = Layout::new(&[(AxisName::Tp, 8)], false);
    let workload = Workload::training(4096, 1);
    let ours = layer_activations(&model, &layout, &workload, Recompute::None).total();
    let megatron = korthikanti_layer(Table2Row::TensorParallelSelective, 4096.0, 1.0, 4096.0, 32.0, 8.0);
    same_bytes("megatron's layer", megatron, 218_103_808.0);
    let (s, h, f, a, t) = (4096.0, 4096.0, 11008.0, 32.0, 8.0);
    // Llama has no dropout (Megatron's 10 counts two 1-byte masks), its gated MLP keeps 3 f-wide
    // tensors (6f bytes a token, not GPT's 16h), and flash attention keeps a 4-byte log-sum-exp a
    // head.
    let dropout_masks = 2.0 * s * h;
    let gated_mlp = (6.0 * f - 16.0 * h) * s / t;
    let log_sum_exp = 4.0 * a / t * s;
    same_bytes("ours", ours, megatron - dropout_masks + gated_mlp + log_sum_exp);
    same_bytes("ours by hand", ours, 184_877_056.0);
    // The parameters a rank: exactly the published count over 8, plus the norms kept whole.
    let stage = &memory_per_stage(&model, &layout, &workload)[0];
    let norms = 65.0 * h; // 32 layers x 2 norms + the final norm
    same_bytes("params", stage.param_count, 6_738_415_616.0 / 8.0 + norms * (1.0 - 1.0 / 8.0));
}

// === Llama-3-70B, TP=8, PP=4, SP, selective recompute, distributed optimizer over dp=8 ===

fn llama3_args() -> MegatronArgs {
    MegatronArgs {
        num_layers: 80,
        hidden_size: 8192,
        ffn_hidden_size: 28672,
        num_attention_heads: 64,
        num_query_groups: 8,
        kv_channels: 128,
        swiglu: true,
        rms_norm: true,
        padded_vocab_size: 128256,
        untie_embeddings_and_output_weights: true,
        seq_length: 8192,
        micro_batch_size: 1,
        tensor_model_parallel_size: 8,
        pipeline_model_parallel_size: 4,
        virtual_pipeline_model_parallel_size: None,
        data_parallel_size: 8,
        use_distributed_optimizer: true,
        sequence_parallel: true,
        selective_recompute: true,
    }
}

#[test]
fn llama3_70b_megatron_by_hand() {
    // Attention 2h²(1 + 8/64) = 150,994,944; a layer 2h(1.5f + 1) + that = 855,654,400; the block
    // 80 layers + h = 68,452,360,192; the first stage (block/4 + embedding 1,050,673,152)/8 =
    // 2,270,470,400 parameters at 6 + 12/8 = 7.5 bytes.
    let memory = theoretical_memory(&llama3_args(), Some(8));
    same_bytes("weights", memory.weight_and_optimizer_bytes, 2_270_470_400.0 * 7.5);
    assert_eq!(2_270_470_400u64 * 15 / 2, 17_028_528_000);
    // sbh(18 + 4·28672/8192) = 67,108,864·32 a layer; 80 layers; + 8sbp 262,144 + sbhp
    // 268,435,456; min(1, 8/4) = 1; over 8.
    same_bytes("activations", memory.activation_bytes, 21_508_423_680.0);
    assert_eq!((2_147_483_648u64 * 80 + 262_144 + 268_435_456) / 8, 21_508_423_680);
}

#[test]
fn llama3_70b_general_model_equals_megatron_up_to_named_terms() {
    let model = ModelShape::from_config(&preset("llama3-70b").unwrap());
    let layout = Layout::new(&[(AxisName::Dp, 8), (AxisName::Pp, 4), (AxisName::Tp, 8)], true);
    let workload = Workload {
        micro_batches: 8,
        recompute: Recompute::Selective,
        distributed_optimizer: true,
        ..Workload::training(8192, 1)
    };
    let stage = &memory_per_stage(&model, &layout, &workload)[0];
    let megatron = theoretical_memory(&llama3_args(), Some(8));
    let h = 8192.0;
    let norms_whole_on_tp = 20.0 * 2.0 * h * (1.0 - 1.0 / 8.0);
    let final_norm_spread = h / 32.0;
    same_bytes(
        "static",
        stage.static_bytes(),
        megatron.weight_and_optimizer_bytes + 7.5 * (norms_whole_on_tp - final_norm_spread),
    );
    // Per layer, per token (before /t): Megatron's 18h + 4f assumes MHA, masks and a plain MLP;
    // Llama 3 has GQA (K, V of 8 heads: 4h - 4kv bytes fewer), no masks (2h fewer), a gated MLP
    // (2f more), and flash's log-sum-exp (4a more).
    let (s, f, kv, a, t) = (8192.0, 28672.0, 1024.0, 64.0, 8.0);
    let per_token = -(4.0 * h - 4.0 * kv) - 2.0 * h + 2.0 * f + 4.0 * a;
    let ours = layer_activations(&model, &layout, &workload, Recompute::Selective).total();
    let theirs =
        korthikanti_layer(Table2Row::TensorSequenceParallelSelective, s, 1.0, h, a, t) * (18.0 + 4.0 * f / h) / 34.0;
    same_bytes("layer", ours, theirs + per_token * s / t);
}

// === The TSP paper: tsp-7b on 8 MI300X, training, batch 1, full recompute ===

fn paper_estimate(mesh: &[(AxisName, u64)], seq: u64) -> f64 {
    let model = ModelShape::from_config(&preset("tsp-7b").unwrap());
    let hw = HardwareSpec::builtin("mi300x").unwrap();
    let workload = Workload { recompute: Recompute::Full, ..Workload::training(seq, 1) };
    estimate(&model, &Layout::new(mesh, false), &workload, &hw).unwrap().memory.peak_bytes
}

/// The paper's TP/TSP ratio at 128K (70.0 / 38.8) and at 16K (31.5 / 31.0).
const PAPER_RATIO_128K: f64 = 70.0 / 38.8;
const PAPER_RATIO_16K: f64 = 31.5 / 31.0;

#[test]
fn tsp_paper_ranking_and_ratios() {
    let tp = |seq| paper_estimate(&[(AxisName::Tp, 8)], seq);
    let tsp = |seq| paper_estimate(&[(AxisName::Tsp, 8)], seq);
    let tp4_sp2 = |seq| paper_estimate(&[(AxisName::Sp, 2), (AxisName::Tp, 4)], seq);
    let tp2_sp4 = |seq| paper_estimate(&[(AxisName::Sp, 4), (AxisName::Tp, 2)], seq);
    // The paper's order at 128K, TSP < TP < every TP+SP layout, holds at every length it swept.
    for seq in [16384, 32768, 65536, 131072] {
        assert!(tsp(seq) < tp(seq), "tsp < tp at {seq}");
        assert!(tp(seq) < tp4_sp2(seq), "tp < tp4 x sp2 at {seq}");
        assert!(tp4_sp2(seq) < tp2_sp4(seq), "tp4 x sp2 < tp2 x sp4 at {seq}");
    }
    // The model's own ratios (no fitted constant): 2.00 at 128K, 1.005 at 16K.
    let ratio_128k = tp(131072) / tsp(131072);
    let ratio_16k = tp(16384) / tsp(16384);
    assert!((ratio_128k - 2.0).abs() < 0.01, "{ratio_128k}");
    assert!((ratio_16k - 1.005).abs() < 0.005, "{ratio_16k}");
    // Tolerances against the paper: 12 % at 128K, 2 % at 16K. What accounts for the rest, term by
    // term (`tsp_paper_figures_term_by_term_at_128k` has pleat's side to the byte):
    // - static, activations, transients and logits: pleat's formulas, each checked to the byte in
    //   the next test; TP's 65.0 GB sits 5.0 GB under the paper's 70.0 and TSP's 32.5 GB 6.3 GB
    //   under its 38.8, about the same absolute gap;
    // - a constant every measured figure includes and no formula has: the runtime's own memory (HIP
    //   context, RCCL buffers, the caching allocator's reserve and fragmentation). It adds the same
    //   bytes to TP and TSP, so it pulls the ratio towards 1: fitting that one constant to the 128K
    //   ratio gives about 8 GB, and with it all four figures land within 8 % of the paper (checked
    //   here, not used by the model).
    assert!((ratio_128k / PAPER_RATIO_128K - 1.0).abs() < 0.12, "{ratio_128k}");
    assert!((ratio_16k / PAPER_RATIO_16K - 1.0).abs() < 0.02, "{ratio_16k}");
    let reserve = (tp(131072) - PAPER_RATIO_128K * tsp(131072)) / (PAPER_RATIO_128K - 1.0);
    assert!((7e9..9e9).contains(&reserve), "{reserve}");
    for (got, paper) in [(tp(131072), 70.0e9), (tsp(131072), 38.8e9), (tp(16384), 31.5e9), (tsp(16384), 31.0e9)] {
        assert!(((got + reserve) / paper - 1.0).abs() < 0.08, "{got} + {reserve} vs {paper}");
    }
}

#[test]
fn tsp_paper_figures_term_by_term_at_128k() {
    let model = ModelShape::from_config(&preset("tsp-7b").unwrap());
    let workload = Workload { recompute: Recompute::Full, ..Workload::training(131072, 1) };
    let memory = |mesh: &[(AxisName, u64)]| memory_per_stage(&model, &Layout::new(mesh, false), &workload)[0].clone();
    let tp = memory(&[(AxisName::Tp, 8)]);
    let tsp = memory(&[(AxisName::Tsp, 8)]);
    let (s, h) = (131072.0, 4096.0);
    // Static: both split every layer matrix by 8 (18 bytes); TSP keeps the 2·32000·h embedding and
    // LM head whole (the term that reproduces the 16K figures, see `memory`'s docs).
    let tables = 2.0 * 32000.0 * h * 18.0;
    same_bytes("static", tsp.static_bytes() - tp.static_bytes(), tables * (1.0 - 1.0 / 8.0));
    // Checkpoints: 32 layer inputs of 2sbh, whole under TP, an eighth under TSP; plus the final
    // norm's and LM head's inputs on the last stage (4sbh).
    same_bytes("tp activations", tp.activations_bytes, 32.0 * 2.0 * s * h + 4.0 * s * h + 4.0 * s);
    same_bytes("tsp activations", tsp.activations_bytes, (32.0 * 2.0 * s * h + 4.0 * s * h + 4.0 * s) / 8.0);
    // Logits: s/8 tokens x 32000 under TSP, s x 4000 under TP: the same 524M elements at 6 bytes.
    same_bytes("logits", tp.logits_bytes, tsp.logits_bytes);
    same_bytes("logits bytes", tp.logits_bytes, s * 4000.0 * 6.0);
    // The TP layer's recompute working set: 8h replicated + 32h/8 split + 16 bytes of
    // log-sum-exp a token (12h + 16); the backward's gradient pair 4h a token.
    let working = tp.transients.iter().find(|term| term.name == "recomputed layer's activations").unwrap();
    same_bytes("tp working layer", working.bytes, s * (12.0 * h + 16.0));
    // The peaks: TP 65.0 GB, TSP 32.5 GB.
    assert!((tp.peak_bytes / 1e9 - 65.02).abs() < 0.01, "{}", tp.peak_bytes);
    assert!((tsp.peak_bytes / 1e9 - 32.48).abs() < 0.01, "{}", tsp.peak_bytes);
}

#[test]
fn tp_sp_layouts_and_the_papers_85_and_140_gb() {
    // The TP+SP layouts: TP on one axis, SP (tokens split, weights replicated, attention over
    // all-gathered K/V) on the other. Term by term at 128K, full recompute, against TP's 65.0 GB:
    // - static: t = 4 or 2 instead of 8 doubles or quadruples the model state (+19.9, +59.8 GB);
    // - layer inputs: s/S tokens instead of s (-18.3, -27.4 GB);
    // - the gathered K/V of every layer, kept for the attention's backward because recompute does
    //   not re-gather them: 32 · 2 · s · (h/t) bf16 elements (+17.2, +34.4 GB);
    // - the recomputed layer's working set and the backward's transients (a few GB either way).
    let model = ModelShape::from_config(&preset("tsp-7b").unwrap());
    let workload = Workload { recompute: Recompute::Full, ..Workload::training(131072, 1) };
    let memory = |mesh: &[(AxisName, u64)]| memory_per_stage(&model, &Layout::new(mesh, false), &workload)[0].clone();
    let (s, h) = (131072.0, 4096.0);
    let kept_kv = |t: f64| 32.0 * 2.0 * s * (h / t) * 2.0;
    let checkpoints = |tokens: f64| 32.0 * 2.0 * tokens * h + 4.0 * tokens * h + 4.0 * tokens;
    for (t, sp) in [(4u64, 2u64), (2, 4)] {
        let stage = memory(&[(AxisName::Sp, sp), (AxisName::Tp, t)]);
        let tokens = s / sp as f64;
        same_bytes(&format!("t={t} activations"), stage.activations_bytes, checkpoints(tokens) + kept_kv(t as f64));
        // The forward's gathered K/V are activations now; the backward's whole-sequence dK/dV wait
        // for their reduce-scatter.
        let dkdv = stage.transients.iter().find(|term| term.name == "sp dk/dv before the reduce-scatter").unwrap();
        same_bytes(&format!("t={t} dk/dv"), dkdv.bytes, 2.0 * s * (h / t as f64) * 2.0);
    }
    let tp4_sp2 = paper_estimate(&[(AxisName::Sp, 2), (AxisName::Tp, 4)], 131072);
    let tp2_sp4 = paper_estimate(&[(AxisName::Sp, 4), (AxisName::Tp, 2)], 131072);
    let tp8 = paper_estimate(&[(AxisName::Tp, 8)], 131072);
    // 81.2 and 128.0 GB against the paper's 85 and 140: 4.5 % and 8.6 % under, the side and size of
    // TP's gap (65.0 against 70.0, the runtime's own memory).
    assert!((tp4_sp2 / 1e9 - 81.18).abs() < 0.01, "{tp4_sp2}");
    assert!((tp2_sp4 / 1e9 - 127.99).abs() < 0.01, "{tp2_sp4}");
    assert!((tp4_sp2 / 85.0e9 - 1.0).abs() < 0.06, "{tp4_sp2}");
    assert!((tp2_sp4 / 140.0e9 - 1.0).abs() < 0.10, "{tp2_sp4}");
    assert!(tp8 < tp4_sp2);
    // The term was derived, not fitted; its form is checked against what it was not derived from:
    // what the paper measured beyond every other term grows 2.2 times from t=4 to t=2 (21.0 GB to
    // 46.4 GB), and the term's 1/t gives 2.
    let others = |estimate: f64, t: f64| estimate - kept_kv(t);
    let excess_t4 = 85.0e9 - others(tp4_sp2, 4.0);
    let excess_t2 = 140.0e9 - others(tp2_sp4, 2.0);
    assert!((excess_t2 / excess_t4 - 2.2).abs() < 0.05, "{}", excess_t2 / excess_t4);
    assert_eq!(kept_kv(2.0) / kept_kv(4.0), 2.0);
}

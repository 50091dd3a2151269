//! Which of a rank's parameters ZeRO splits, and over how many replicas.
//!
//! The executor splits a parameter's rows (its first dim, after the layout's own splits; once a
//! rank holds one row, the next dim) over each of its data-parallel axes in turn whose degree
//! still divides them, and keeps the rest of them whole (`pleat_ir::ShardSpec::with_rows_split`): a dense parameter over dp, cp and then ep (cp's
//! ranks hold the same weights, and ep splits the batch as dp does), a routed expert, which ep (or
//! tsp without ep) already splits, over dp and cp.
//! [`super::memory`]'s closed form divides every parameter by all of its replicas, as Megatron's
//! distributed optimizer and DeepSpeed do with their flat buffers. The two differ by the bytes of
//! the parameters whose rows do not divide, beyond their closed-form shards: on `tiny` (4 kv
//! heads) at dp=4 × tp=2 each k and v projection keeps its 2 rows a rank whole. (Once a rank holds
//! one row the split goes on in the next dim: at dp=2 × tp=4, k's one head a rank splits on
//! head_dim, as at dp=2 × ep=2 × tp=2 once dp has split its 2 rows.)
//!
//! The rows a rank's parameters have: q, k and v (and their biases) their heads over tp (k and v
//! whole when tp does not divide the kv heads) and over tsp; o, down, the norms and the shared
//! expert's gate vector `h`; gate and up their channels over tp and tsp; the router its `E`
//! experts; a routed expert matrix `E/ep` (`E/tsp` when tsp places them); the embedding table and
//! the LM head their vocabulary over tp (and tsp, which shards the tables).

use pleat_ir::AxisName;

use super::activation::kv_split;
use super::layout::Layout;
use super::model::ModelShape;

/// A parameter tensor a rank holds: its local dims (after the layout's own splits), how many
/// such tensors (a LayerNorm's scale and bias), and whether it is a routed expert's.
#[derive(Clone)]
struct RankParam {
    dims: Vec<u64>,
    copies: u64,
    expert: bool,
}

impl RankParam {
    fn dense(dims: &[u64]) -> RankParam {
        RankParam { dims: dims.to_vec(), copies: 1, expert: false }
    }

    fn elements(&self) -> f64 {
        (self.copies * self.dims.iter().product::<u64>()) as f64
    }
}

/// A rank's parameters by their dims, and the replicas ZeRO splits them over.
pub struct ZeroRows {
    /// The degrees of dp, cp and ep (`pleat_ir::ZERO_AXES`).
    dp: u64,
    cp: u64,
    ep: u64,
    /// One layer's parameters: those its attention reads (the attention norm, q's weight and
    /// bias, k and v), and the rest (o, the MLP norm, the MLP or a mixture's shared expert, and a
    /// mixture's router and routed experts), which its backward finishes first.
    attention_norm: RankParam,
    query_weight: RankParam,
    query_bias: Option<RankParam>,
    key_values: Vec<RankParam>,
    past_attention: Vec<RankParam>,
    /// Of those, o's, one of gate and up (their dims; one of them without a gate), and down's.
    output: RankParam,
    up: RankParam,
    gated: bool,
    down: RankParam,
    router: Option<RankParam>,
    routed_experts: Vec<RankParam>,
    /// The final norm's and the LM head's (the head's only when the embedding is untied).
    head: Vec<RankParam>,
    /// The embedding table's.
    embedding: RankParam,
}

impl ZeroRows {
    /// The parameters of a rank of `layout` (tp, tsp and ep splits; dp, cp and ep replicas).
    pub fn new(model: &ModelShape, layout: &Layout) -> ZeroRows {
        let tp = layout.degree(AxisName::Tp);
        let split = tp * layout.degree(AxisName::Tsp);
        let (hidden, head_dim) = (model.hidden, model.head_dim);
        let kv_split = kv_split(model, layout) * layout.degree(AxisName::Tsp);
        let norm = RankParam { dims: vec![hidden], copies: model.norm.params(hidden) / hidden, expert: false };
        let heads = |params: &mut Vec<RankParam>, count: u64, split: u64| {
            let rows = count / split;
            params.push(RankParam::dense(&[rows, head_dim, hidden]));
            if model.qkv_bias {
                params.push(RankParam::dense(&[rows, head_dim]));
            }
        };
        let query_rows = model.heads / split;
        let query_bias = model.qkv_bias.then(|| RankParam::dense(&[query_rows, head_dim]));
        let mut key_values = Vec::new();
        heads(&mut key_values, model.kv_heads, kv_split);
        heads(&mut key_values, model.kv_heads, kv_split);
        let output = RankParam::dense(&[hidden, query_rows, head_dim]);
        let mut layer = vec![output.clone(), norm.clone()];
        // The dense MLP, or a mixture's shared expert (none when its width is 0): gate and up (or
        // in) split by channels, down (or out) keeps `h` rows.
        let channels = model.ffn / split;
        let (up, down) = (RankParam::dense(&[channels, hidden]), RankParam::dense(&[hidden, channels]));
        for _ in 1..model.mlp_matrices() {
            layer.push(up.clone());
        }
        layer.push(down.clone());
        let (mut router, mut routed_experts) = (None, Vec::new());
        if let Some(experts) = &model.experts {
            router = Some(RankParam::dense(&[experts.count, hidden]));
            if experts.shared_expert {
                layer.push(RankParam::dense(&[hidden]));
            }
            for dims in ZeroRows::expert_dims(model, layout) {
                routed_experts.push(RankParam { dims: dims.to_vec(), copies: 1, expert: true });
            }
        }
        let vocab = model.vocab.div_ceil(split);
        let table = RankParam::dense(&[vocab, hidden]);
        let mut head =
            vec![RankParam { dims: vec![hidden], copies: model.final_norm_params() / hidden, expert: false }];
        if !model.tied_embeddings {
            head.push(table.clone());
        }
        ZeroRows {
            dp: layout.degree(AxisName::Dp),
            cp: layout.degree(AxisName::Cp),
            ep: layout.degree(AxisName::Ep),
            attention_norm: norm,
            query_weight: RankParam::dense(&[query_rows, head_dim, hidden]),
            query_bias,
            key_values,
            past_attention: layer,
            output,
            up,
            gated: model.mlp_matrices() > 2,
            down,
            router,
            routed_experts,
            head,
            embedding: table,
        }
    }

    /// The local dims of a layer's three routed expert matrices on a rank: gate and up
    /// `[E/ep, f/tp, h]`, down `[E/ep, h, f/tp]`.
    pub fn expert_dims(model: &ModelShape, layout: &Layout) -> [[u64; 3]; 3] {
        let Some(experts) = &model.experts else { return [[0; 3]; 3] };
        let local = experts.count / layout.expert_degree();
        let channels = experts.ffn / layout.degree(AxisName::Tp);
        [[local, channels, model.hidden], [local, channels, model.hidden], [local, model.hidden, channels]]
    }

    /// The replicas ZeRO splits a parameter of local `dims` over: a dense one over dp, cp, then
    /// ep, a routed expert over dp and cp; each axis splits the first dim whose size left is above
    /// one, where it divides it (`pleat_ir::ShardSpec::with_rows_split`).
    pub fn replicas(&self, dims: &[u64], expert: bool) -> u64 {
        let axes: &[u64] = if expert { &[self.dp, self.cp] } else { &[self.dp, self.cp, self.ep] };
        let mut sizes = dims.to_vec();
        let mut replicas = 1;
        for &degree in axes.iter().filter(|&&degree| degree > 1) {
            if let Some(size) = sizes.iter_mut().find(|size| **size != 1) {
                if *size % degree == 0 {
                    *size /= degree;
                    replicas *= degree;
                }
            }
        }
        replicas
    }

    /// The replicas the closed form divides a parameter by: a dense one's dp·cp·ep, an expert's
    /// dp·cp.
    fn closed_form_replicas(&self, expert: bool) -> u64 {
        if expert {
            self.dp * self.cp
        } else {
            self.dp * self.cp * self.ep
        }
    }

    /// The elements of `params` a rank holds beyond the closed form's shards.
    fn beyond<'a>(&self, params: impl IntoIterator<Item = &'a RankParam>) -> f64 {
        params
            .into_iter()
            .map(|param| {
                let elements = param.elements();
                elements / self.replicas(&param.dims, param.expert) as f64
                    - elements / self.closed_form_replicas(param.expert) as f64
            })
            .sum()
    }

    /// The elements of `layers` layers, and of the head (final norm and an untied LM head) and
    /// the embedding table where asked, that a rank holds beyond the closed form's ZeRO shards.
    pub fn beyond_shards(&self, layers: u64, head: bool, embedding: bool) -> f64 {
        let layer = self.beyond([&self.attention_norm])
            + self.beyond_query_weight()
            + self.beyond_query_bias()
            + self.beyond_key_values()
            + self.beyond_shards_past_attention();
        let mut elements = layers as f64 * layer;
        if head {
            elements += self.beyond(&self.head);
        }
        if embedding {
            elements += self.beyond([&self.embedding]);
        }
        elements
    }

    /// The elements of one layer's parameters but those its attention reads (o, the MLP norm, the
    /// MLP or the mixture) that a rank holds beyond the closed form's ZeRO shards.
    pub fn beyond_shards_past_attention(&self) -> f64 {
        self.beyond(&self.past_attention) + self.beyond_router() + self.beyond_routed_experts()
    }

    /// The elements of one layer's attention norm that a rank holds beyond the closed form's ZeRO
    /// shards.
    pub fn beyond_attention_norm(&self) -> f64 {
        self.beyond([&self.attention_norm])
    }

    /// The elements of one layer's dense parameters past its attention (o, the MLP norm, the MLP
    /// or a shared expert; not a router or routed experts) that a rank holds beyond the closed
    /// form's ZeRO shards.
    pub fn beyond_dense_past_attention(&self) -> f64 {
        self.beyond(&self.past_attention)
    }

    /// The elements of one layer's down projection (a dense MLP's or a shared expert's) that a
    /// rank holds beyond the closed form's ZeRO shards.
    pub fn beyond_down(&self) -> f64 {
        self.beyond([&self.down])
    }

    /// The same of its up projection.
    pub fn beyond_up(&self) -> f64 {
        self.beyond([&self.up])
    }

    /// The same of its gate projection (none without a gate).
    pub fn beyond_gate(&self) -> f64 {
        if self.gated {
            self.beyond_up()
        } else {
            0.0
        }
    }

    /// Whether ZeRO splits a layer's norms (the final norm and a shared expert's gate vector, of
    /// the same rows, too), so that ZeRO-3 gathers them whole before use; else it keeps them whole.
    pub fn splits_norms(&self) -> bool {
        self.splits(&self.attention_norm.dims, false)
    }

    /// The same of its gate and up projections.
    pub fn splits_up(&self) -> bool {
        self.splits(&self.up.dims, false)
    }

    /// The same of its down projection.
    pub fn splits_down(&self) -> bool {
        self.splits(&self.down.dims, false)
    }

    /// The same of its o projection.
    pub fn splits_output(&self) -> bool {
        self.splits(&self.output.dims, false)
    }

    /// The elements of one layer's router (none for a dense model) that a rank holds beyond the
    /// closed form's ZeRO shards.
    pub fn beyond_router(&self) -> f64 {
        self.beyond(&self.router)
    }

    /// The elements of one layer's routed experts on a rank (none for a dense model) that it holds
    /// beyond the closed form's ZeRO shards.
    pub fn beyond_routed_experts(&self) -> f64 {
        self.beyond(&self.routed_experts)
    }

    /// The replicas ZeRO splits a layer's router over, all of the closed form's, some or none
    /// (`None` for a dense model).
    pub fn router_replicas(&self) -> Option<u64> {
        self.router.as_ref().map(|param| self.replicas(&param.dims, param.expert))
    }

    /// The replicas ZeRO splits a layer's routed experts on a rank over (all three alike; `None`
    /// for a dense model).
    pub fn routed_experts_replicas(&self) -> Option<u64> {
        self.routed_experts.first().map(|param| self.replicas(&param.dims, param.expert))
    }

    /// The elements of a vocabulary table a rank holds (the embedding's, and an untied LM head's,
    /// of the same rows) beyond the closed form's ZeRO shard.
    pub fn beyond_vocabulary_table(&self) -> f64 {
        self.beyond([&self.embedding])
    }

    /// The replicas ZeRO splits the vocabulary tables over, all of the closed form's, some or none
    /// (1: it keeps them whole, and ZeRO-3 does not gather them).
    pub fn vocabulary_table_replicas(&self) -> u64 {
        self.replicas(&self.embedding.dims, false)
    }

    /// The elements of the final norm that a rank holds beyond the closed form's ZeRO shards.
    pub fn beyond_final_norm(&self) -> f64 {
        self.beyond(&self.head[..1])
    }

    /// The elements of one layer's k and v projections (and their biases) that a rank holds
    /// beyond the closed form's ZeRO shards.
    pub fn beyond_key_values(&self) -> f64 {
        self.beyond(&self.key_values)
    }

    /// The elements of one layer's q projection weight that a rank holds beyond the closed form's
    /// ZeRO shards.
    pub fn beyond_query_weight(&self) -> f64 {
        self.beyond([&self.query_weight])
    }

    /// The elements of one layer's q bias (none without one) that a rank holds beyond the closed
    /// form's ZeRO shards: of q's rows, so kept whole where its weight is.
    pub fn beyond_query_bias(&self) -> f64 {
        self.beyond(&self.query_bias)
    }

    /// Whether ZeRO splits a layer's q projection (and its bias, of the same rows), so that
    /// ZeRO-3 gathers it whole before use; else it keeps it whole.
    pub fn splits_query(&self) -> bool {
        self.splits(&self.query_weight.dims, false)
    }

    /// Whether ZeRO splits a layer's k and v projections (and their biases, of the same rows), so
    /// that ZeRO-3 gathers them whole before use; else it keeps them whole.
    pub fn splits_key_values(&self) -> bool {
        self.key_values.iter().all(|param| self.splits(&param.dims, false))
    }

    /// Whether ZeRO splits any of the rank's parameters: where it splits none (at dp=3 on `tiny`
    /// no dim divides), ZeRO-2 and 3 keep every gradient and weight whole, as ZeRO-1 does.
    pub fn splits_any(&self) -> bool {
        let attention_inputs = [&self.attention_norm, &self.query_weight].into_iter().chain(&self.query_bias);
        let layer = attention_inputs
            .chain(&self.key_values)
            .chain(&self.past_attention)
            .chain(&self.router)
            .chain(&self.routed_experts);
        // (A mixture without a shared expert lists its MLP as empty tensors, which split nothing.)
        layer
            .chain(&self.head)
            .chain([&self.embedding])
            .any(|param| param.elements() > 0.0 && self.splits(&param.dims, param.expert))
    }

    /// A rank's ZeRO shard of `amount` (elements or bytes) of a parameter of local `dims`.
    pub fn shard(&self, dims: &[u64], amount: f64, expert: bool) -> f64 {
        amount / self.replicas(dims, expert) as f64
    }

    /// Whether ZeRO splits a parameter of local `dims` (so that ZeRO-3 gathers it before use).
    pub fn splits(&self, dims: &[u64], expert: bool) -> bool {
        self.replicas(dims, expert) > 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::memory::stage_params;
    use crate::cost::workload::Workload;
    use pleat_ir::model::preset::preset;

    fn shape(name: &str) -> ModelShape {
        ModelShape::from_config(&preset(name).unwrap())
    }

    #[test]
    fn the_rows_list_every_parameter_of_the_rank() {
        // The elements listed are the closed form's parameters a rank, for each layout.
        let workload = Workload { tsp_shards_embeddings: true, ..Workload::training(16, 1) };
        for (name, axes) in [
            ("tiny", vec![(AxisName::Tp, 2)]),
            ("tiny", vec![(AxisName::Tp, 8)]),
            ("tiny", vec![(AxisName::Tsp, 2)]),
            ("tiny-moe", vec![(AxisName::Ep, 2), (AxisName::Tp, 2)]),
            ("tiny-moe", vec![(AxisName::Tsp, 2)]),
            ("llama3-70b", vec![(AxisName::Tp, 8)]),
            ("mixtral-8x7b", vec![(AxisName::Ep, 4), (AxisName::Tp, 2)]),
        ] {
            let model = shape(name);
            let layout = Layout::new(&axes, false);
            let rows = ZeroRows::new(&model, &layout);
            let elements = |params: &[RankParam]| params.iter().map(RankParam::elements).sum::<f64>();
            let attention_inputs = [rows.attention_norm.clone(), rows.query_weight.clone()];
            let layer = elements(&attention_inputs)
                + rows.query_bias.as_ref().map_or(0.0, RankParam::elements)
                + elements(&rows.key_values)
                + elements(&rows.past_attention)
                + rows.router.as_ref().map_or(0.0, RankParam::elements)
                + elements(&rows.routed_experts);
            let listed = model.layers as f64 * layer + elements(&rows.head) + rows.embedding.elements();
            assert_eq!(listed, stage_params(&model, &layout, &workload, 0, model.layers), "{name} {layout}");
        }
    }

    #[test]
    fn rows_that_do_not_divide_keep_their_parameter_whole_or_split_over_fewer_axes() {
        // tiny at dp=4 × tp=2: k and v have 4/2 = 2 rows a rank, which dp=4 does not divide, so
        // each stays whole: 2·16·128 = 4,096 elements instead of 1,024, 3,072 beyond, two a layer
        // and two layers. Everything else divides.
        let tiny = shape("tiny");
        let rows = ZeroRows::new(&tiny, &Layout::new(&[(AxisName::Dp, 4), (AxisName::Tp, 2)], false));
        assert_eq!(rows.replicas(&[2, 16, 128], false), 1);
        assert_eq!(rows.beyond_shards(2, true, true), 2.0 * 2.0 * 3072.0);
        // All of it k's and v's, neither of which ZeRO-3 gathers; q's 4 rows a rank divide.
        assert_eq!((rows.beyond_key_values(), rows.splits_key_values()), (2.0 * 3072.0, false));
        assert_eq!((rows.beyond_query_weight(), rows.splits_query()), (0.0, true));
        // At dp=8 × tp=2 q's 4 rows a rank stay whole too: 4·16·128 = 8,192 elements instead of
        // 1,024, 7,168 beyond (k's and v's 2 rows, 4,096 instead of 512, 3,584 each).
        let rows = ZeroRows::new(&tiny, &Layout::new(&[(AxisName::Dp, 8), (AxisName::Tp, 2)], false));
        assert_eq!((rows.beyond_query_weight(), rows.beyond_query_bias(), rows.splits_query()), (7168.0, 0.0, false));
        assert_eq!(rows.beyond_key_values(), 2.0 * 3584.0);
        assert_eq!(rows.beyond_shards(2, true, true), 2.0 * (7168.0 + 2.0 * 3584.0));
        // tiny-moe at dp=2 × ep=2 × tp=2: k and v split over dp (2 rows → 1) and then, one row a
        // rank, over ep on head_dim; the experts' 4 rows a rank divide over dp. Six rows would
        // split over dp alone (3 rows left, which ep does not divide).
        let moe = shape("tiny-moe");
        let layout = Layout::new(&[(AxisName::Dp, 2), (AxisName::Ep, 2), (AxisName::Tp, 2)], false);
        let rows = ZeroRows::new(&moe, &layout);
        assert_eq!((rows.replicas(&[2, 16, 128], false), rows.replicas(&[4, 32, 128], true)), (4, 2));
        assert_eq!(rows.replicas(&[6, 16, 128], false), 2);
        assert_eq!(rows.beyond_shards(2, true, true), 0.0);
        // tiny at dp=2 × tp=4: k and v have one row a rank, split over dp on head_dim.
        let one_row = ZeroRows::new(&tiny, &Layout::new(&[(AxisName::Dp, 2), (AxisName::Tp, 4)], false));
        assert_eq!(one_row.replicas(&[1, 16, 128], false), 2);
        assert_eq!(one_row.beyond_shards(2, true, true), 0.0);
        assert_eq!((one_row.beyond_key_values(), one_row.splits_key_values()), (0.0, true));
        // At dp=3 (or 6) no dim of tiny's divides (128, 256, 8 heads, 4 kv heads): ZeRO splits
        // nothing. tiny-moe's 8 experts a rank do not divide over dp=3 either; at dp=2 they do.
        for degree in [3, 6] {
            let layout = Layout::new(&[(AxisName::Dp, degree)], false);
            assert!(!ZeroRows::new(&tiny, &layout).splits_any(), "dp={degree}");
            assert!(!ZeroRows::new(&moe, &layout).splits_any(), "dp={degree}");
        }
        assert!(ZeroRows::new(&tiny, &Layout::new(&[(AxisName::Dp, 2)], false)).splits_any());
    }

    #[test]
    fn vocabulary_tables_split_over_all_their_replicas_some_or_none() {
        // 250 vocabulary rows: dp=4 does not divide them, so both tables stay whole, 250·128 =
        // 32,000 elements a table against 8,000, 24,000 beyond; at dp=2 × cp=2 dp splits them to
        // 125, which cp does not divide: 16,000 against 8,000. tiny's 256 split over both; its
        // final norm's 128 rows divide everywhere here.
        let odd = ModelShape::from_config(&pleat_ir::model::config::ModelConfig {
            vocab_size: 250,
            ..preset("tiny").unwrap()
        });
        let rows = |model: &ModelShape, axes: &[(AxisName, u64)]| ZeroRows::new(model, &Layout::new(axes, false));
        let at_dp4 = rows(&odd, &[(AxisName::Dp, 4)]);
        assert_eq!((at_dp4.vocabulary_table_replicas(), at_dp4.beyond_vocabulary_table()), (1, 24_000.0));
        assert_eq!(at_dp4.beyond_final_norm(), 0.0);
        // Both tables and nothing else beyond (the embedding and the untied head).
        assert_eq!(at_dp4.beyond_shards(2, true, true), 2.0 * 24_000.0);
        let beside_cp = rows(&odd, &[(AxisName::Dp, 2), (AxisName::Cp, 2)]);
        assert_eq!((beside_cp.vocabulary_table_replicas(), beside_cp.beyond_vocabulary_table()), (2, 8_000.0));
        let tiny = rows(&shape("tiny"), &[(AxisName::Dp, 2), (AxisName::Cp, 2)]);
        assert_eq!((tiny.vocabulary_table_replicas(), tiny.beyond_vocabulary_table()), (4, 0.0));
    }

    #[test]
    fn a_mixtures_router_and_experts_split_over_all_their_replicas_some_or_none() {
        let six_experts = {
            let config = preset("tiny-moe").unwrap();
            let moe = config.moe.clone().map(|moe| pleat_ir::model::config::MoeConfig { num_experts: 6, ..moe });
            ModelShape::from_config(&pleat_ir::model::config::ModelConfig { moe, ..config })
        };
        let rows = |model: &ModelShape, axes: &[(AxisName, u64)]| ZeroRows::new(model, &Layout::new(axes, false));
        // Six experts at dp=4: the router's 6 rows do not divide, nor the experts' 6 a rank, so
        // both stay whole: the router's 6·128 = 768 elements keep 768 − 192 = 576 beyond its
        // shard, each expert matrix's 6·64·128 = 49,152 keeps 36,864, three of them 110,592.
        let at_dp4 = rows(&six_experts, &[(AxisName::Dp, 4)]);
        assert_eq!((at_dp4.router_replicas(), at_dp4.routed_experts_replicas()), (Some(1), Some(1)));
        assert_eq!((at_dp4.beyond_router(), at_dp4.beyond_routed_experts()), (576.0, 110_592.0));
        assert_eq!(at_dp4.beyond_shards_past_attention(), 576.0 + 110_592.0);
        // At tsp=2 × dp=2 the router's 6 rows split to 3, but the experts' 3 a rank (tsp places
        // them) do not: 3·64·128 = 24,576 a matrix keeps 12,288, 36,864 the three.
        let beside_tsp = rows(&six_experts, &[(AxisName::Tsp, 2), (AxisName::Dp, 2)]);
        assert_eq!((beside_tsp.router_replicas(), beside_tsp.routed_experts_replicas()), (Some(2), Some(1)));
        assert_eq!((beside_tsp.beyond_router(), beside_tsp.beyond_routed_experts()), (0.0, 36_864.0));
        // At dp=2 × ep=2 dp splits the router's 6 rows to 3, which ep does not divide: split over
        // some of its replicas (768/2 − 768/4 = 192 beyond); the experts' 3 a rank (ep splits
        // them) do not divide over dp, their only replicas: whole.
        let beside_ep = rows(&six_experts, &[(AxisName::Dp, 2), (AxisName::Ep, 2)]);
        assert_eq!((beside_ep.router_replicas(), beside_ep.routed_experts_replicas()), (Some(2), Some(1)));
        assert_eq!(beside_ep.beyond_router(), 192.0);
        // tiny-moe's 8 experts at dp=8 × ep=2: the router's 8 rows split over dp to 1, then on
        // hidden over ep, all its replicas; the experts' 4 a rank stay whole (4·64·128 = 32,768 a
        // matrix keeps 28,672). A dense model has neither.
        let tiny_moe = shape("tiny-moe");
        let wide_dp = rows(&tiny_moe, &[(AxisName::Dp, 8), (AxisName::Ep, 2)]);
        assert_eq!((wide_dp.router_replicas(), wide_dp.routed_experts_replicas()), (Some(16), Some(1)));
        assert_eq!(wide_dp.beyond_routed_experts(), 3.0 * 28_672.0);
        let dense = rows(&shape("tiny"), &[(AxisName::Dp, 4)]);
        assert_eq!((dense.router_replicas(), dense.routed_experts_replicas()), (None, None));
    }
}

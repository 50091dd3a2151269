//! Which of a rank's parameters ZeRO splits, and over how many replicas.
//!
//! The executor splits a parameter's rows (its first dim, after the layout's own splits) over each
//! of its data-parallel axes in turn whose degree still divides them, and keeps the rest of them
//! whole (`pleat_ir::ShardSpec::with_rows_split`): a dense parameter over dp, cp and then ep (cp's
//! ranks hold the same weights, and ep splits the batch as dp does), a routed expert, which ep (or
//! tsp without ep) already splits, over dp and cp.
//! [`super::memory`]'s closed form divides every parameter by all of its replicas, as Megatron's
//! distributed optimizer and DeepSpeed do with their flat buffers. The two differ by the bytes of
//! the parameters whose rows do not divide, beyond their closed-form shards: on `tiny` (4 kv
//! heads) at dp=4 × tp=2 each k and v projection keeps its 2 rows a rank whole, and on `tiny-moe`
//! at dp=2 × ep=2 × tp=2 splits them over dp alone.
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

/// A rank's parameters by their rows, and the replicas ZeRO splits them over.
pub struct ZeroRows {
    /// The degrees of dp, cp and ep (`pleat_ir::ZERO_AXES`).
    dp: u64,
    cp: u64,
    ep: u64,
    /// One layer's parameters as `(rows, elements, routed expert)`: those its attention reads
    /// (the attention norm, q, k, v), and the rest (o, the MLP norm, the MLP or the mixture), which
    /// its backward finishes first.
    attention_inputs: Vec<(u64, u64, bool)>,
    past_attention: Vec<(u64, u64, bool)>,
    /// The final norm's and the LM head's (the head's only when the embedding is untied).
    head: Vec<(u64, u64, bool)>,
    /// The embedding table's.
    embedding: (u64, u64, bool),
}

impl ZeroRows {
    /// The parameters of a rank of `layout` (tp, tsp and ep splits; dp and ep replicas).
    pub fn new(model: &ModelShape, layout: &Layout) -> ZeroRows {
        let split = layout.degree(AxisName::Tp) * layout.degree(AxisName::Tsp);
        let (hidden, head_dim) = (model.hidden, model.head_dim);
        let kv_split = kv_split(model, layout) * layout.degree(AxisName::Tsp);
        let norm = (hidden, model.norm.params(hidden), false);
        let mut attention_inputs = vec![norm];
        let mut heads = |count: u64, split: u64| {
            let rows = count / split;
            attention_inputs.push((rows, rows * head_dim * hidden, false));
            if model.qkv_bias {
                attention_inputs.push((rows, rows * head_dim, false));
            }
        };
        heads(model.heads, split);
        heads(model.kv_heads, kv_split);
        heads(model.kv_heads, kv_split);
        let mut layer = vec![(hidden, hidden * model.query_width() / split, false), norm];
        // The dense MLP, or a mixture's shared expert (none when its width is 0): gate and up (or
        // in) split by channels, down (or out) keeps `h` rows.
        let channels = model.ffn / split;
        for _ in 1..model.mlp_matrices() {
            layer.push((channels, channels * hidden, false));
        }
        layer.push((hidden, hidden * channels, false));
        if let Some(experts) = &model.experts {
            layer.push((experts.count, experts.count * hidden, false));
            if experts.shared_expert {
                layer.push((hidden, hidden, false));
            }
            let local = experts.count / layout.expert_degree();
            let matrix = local * hidden * experts.ffn / layout.degree(AxisName::Tp);
            layer.extend([(local, matrix, true); 3]);
        }
        let vocab = model.vocab.div_ceil(split);
        let table = (vocab, vocab * hidden, false);
        let mut head = vec![(hidden, model.final_norm_params(), false)];
        if !model.tied_embeddings {
            head.push(table);
        }
        ZeroRows {
            dp: layout.degree(AxisName::Dp),
            cp: layout.degree(AxisName::Cp),
            ep: layout.degree(AxisName::Ep),
            attention_inputs,
            past_attention: layer,
            head,
            embedding: table,
        }
    }

    /// The replicas ZeRO splits a parameter of `rows` rows over: a dense one over dp, cp, then
    /// ep, a routed expert over dp and cp, each axis while it divides the rows left.
    pub fn replicas(&self, rows: u64, expert: bool) -> u64 {
        let axes: &[u64] = if expert { &[self.dp, self.cp] } else { &[self.dp, self.cp, self.ep] };
        axes.iter().fold(1, |split, &degree| if (rows / split) % degree == 0 { split * degree } else { split })
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
    fn beyond<'a>(&self, params: impl IntoIterator<Item = &'a (u64, u64, bool)>) -> f64 {
        params
            .into_iter()
            .map(|&(rows, elements, expert)| {
                let elements = elements as f64;
                elements / self.replicas(rows, expert) as f64 - elements / self.closed_form_replicas(expert) as f64
            })
            .sum()
    }

    /// The elements of `layers` layers, and of the head (final norm and an untied LM head) and
    /// the embedding table where asked, that a rank holds beyond the closed form's ZeRO shards.
    pub fn beyond_shards(&self, layers: u64, head: bool, embedding: bool) -> f64 {
        let mut elements = layers as f64 * (self.beyond(&self.attention_inputs) + self.beyond(&self.past_attention));
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
        self.beyond(&self.past_attention)
    }

    /// A rank's ZeRO shard of `amount` (elements or bytes) of a parameter of `rows` rows.
    pub fn shard(&self, rows: u64, amount: f64, expert: bool) -> f64 {
        amount / self.replicas(rows, expert) as f64
    }

    /// Whether ZeRO splits a parameter of `rows` rows (so that ZeRO-3 gathers it before use).
    pub fn splits(&self, rows: u64, expert: bool) -> bool {
        self.replicas(rows, expert) > 1
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
            let elements = |params: &[(u64, u64, bool)]| params.iter().map(|param| param.1 as f64).sum::<f64>();
            let layer = elements(&rows.attention_inputs) + elements(&rows.past_attention);
            let listed = model.layers as f64 * layer + elements(&rows.head) + rows.embedding.1 as f64;
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
        assert_eq!(rows.replicas(2, false), 1);
        assert_eq!(rows.beyond_shards(2, true, true), 2.0 * 2.0 * 3072.0);
        // tiny-moe at dp=2 × ep=2 × tp=2: k and v split over dp (2 → 1 row) but not ep, 2,048
        // elements instead of 1,024 each; the experts' 4 rows a rank divide over dp.
        let moe = shape("tiny-moe");
        let layout = Layout::new(&[(AxisName::Dp, 2), (AxisName::Ep, 2), (AxisName::Tp, 2)], false);
        let rows = ZeroRows::new(&moe, &layout);
        assert_eq!((rows.replicas(2, false), rows.replicas(4, true)), (2, 2));
        assert_eq!(rows.beyond_shards(1, false, false), 2.0 * 1024.0);
        assert_eq!(rows.beyond_shards(2, true, true), 4.0 * 1024.0);
        // dp=2 × tp=2 divides everything: nothing beyond.
        let even = ZeroRows::new(&tiny, &Layout::new(&[(AxisName::Dp, 2), (AxisName::Tp, 2)], false));
        assert_eq!(even.beyond_shards(2, true, true), 0.0);
    }
}

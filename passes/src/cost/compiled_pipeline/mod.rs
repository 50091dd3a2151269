//! The peak of a pipelined training stage's compiled program, from closed forms, term by term.
//!
//! A pipelined rank (`backend::pipeline`) replays its stage's part of one micro-batch's training
//! program in its schedule's order, on each micro-batch's own copies of the buffers. What a stage
//! holds at once, beside its parameters:
//! - the **running sums** of its gradients over the micro-batches (program outputs are summed): the
//!   first micro-batch's backward creates each sum as its gradient is finished, a later one adds into
//!   it, the old sum and the new one both live for that instruction;
//! - the **gradients of the micro-batch being backwarded**, each a program output, kept until the
//!   end of its backward step;
//! - every **other micro-batch in flight** (its forward done on this stage, its backward not yet):
//!   all that its forward keeps for the backward, given by the schedule (GPipe: all of them; 1F1B:
//!   up to `p - s` on stage `s`);
//! - what the current micro-batch still holds of its forward and of its gradient chain.
//!
//! The stage peaks at the tail of a micro-batch's backward, as its last large weight gradient joins
//! the sums: on the first stage the embedding's (the last gradient of the step), on the others the
//! first layer's query projection's (only that layer's input norm follows). There the current
//! micro-batch has freed its layers' activations but for its first layer's input and gradients. The
//! candidates are each backward's tail (the in-flight count and the sums differ); the peak is the
//! largest. On somewhat more tokens a dense stage peaks inside its first layer's MLP backward, as
//! the gate projection's weight gradient joins its sum (modelled without tsp or ZeRO-2 and 3, and
//! beside dp or cp without tp, under full recomputation too; under ZeRO-2 and 3, as gate's input
//! gradient is made before it, under ZeRO-3 beside gate's weight gathered again), or inside its
//! attention
//! backward, as the attention kernel makes v's gradient beside q's and k's (every token's under cp,
//! recomputed under full recomputation, where a chunk of more than one layer may peak so in its
//! last layer's too, the layers below holding their residual stream; not under tsp), then as the
//! attention norm output's
//! gradients from v and k, then from q, are summed (under tp partial sums of the whole hidden size;
//! beside cp after k's and v's gradients are reduce-scattered back to the rank's tokens; under
//! ZeRO-2 and 3 their weight gradients' shards made, under ZeRO-3 also as q's input gradient is
//! made beside its weight gathered again; not under tsp, or where ZeRO keeps k and v whole; where
//! tp does not divide the kv heads, as v's and k's weight gradients, whole over tp, join their
//! sums or are reduce-scattered: `replicated_key_values`), or under full recomputation as the
//! first layer's down gradient is made beside the MLP recomputed for it (without tsp; under
//! ZeRO-2 and 3 whole, then as it is reduce-scattered), as
//! it joins its sum (without ZeRO, but beside dp × tp), beside dp or cp as gate's output gradient
//! is made after it, and as the MLP norm output's gradients are summed; and at the head of a
//! backward: the last stage in the loss's backward, or (a dense model
//! without tsp) as the LM head's weight gradient is made (beside dp, or whole before its
//! reduce-scatter under ZeRO-2 and 3) or (without ZeRO-2 and 3) joins its sum (not beside cp but as
//! it joins after dp's or cp's all-reduce; under full recomputation beside the final norm's output
//! recomputed); another as the two parts of the output gradient it received are summed, (without
//! tp, or beside dp) as its last layer's down projection gradient joins its sum; any (with tp too)
//! as that layer's MLP norm output's gradients are summed; any dense stage (without tsp) as the
//! last layer's down gradient is made, under full recomputation beside its MLP recomputed (without
//! replicas also as it joins its sum; beside them as gate's output gradient is made after it),
//! then as its MLP norm output's gradients are summed; under ZeRO-2 and 3 (without tsp) as the last
//! layer's down gradient is made whole or reduce-scattered (under full recomputation beside its MLP
//! recomputed), then as its MLP norm output's gradients are summed, and on the last stage as the LM
//! head's is reduce-scattered (beside a tied table its part of the table's gradient made). Under SP
//! the down gradient's points hold the output gradient gathered over tp too. The head of a backward
//! (all activations and the first gradients live) is smaller wherever the gradients outweigh a
//! micro-batch's activations, as on the models the tests compile with 8 tokens a sequence; on more
//! tokens a stage may peak at other points of it, not modelled, and the result is below the
//! planner's peak (every candidate is the live set at one point of the program, so never above:
//! `tests/cost_training.rs` checks both).
//!
//! Under dp (no ZeRO) each gradient is all-reduced before it joins its sum; at the tail the
//! joining gradient's unreduced copy is live too, and the activations that computed it are freed.
//! A projection's input gradient comes before its weight gradient there, so the head of a backward
//! and the first layer's backward peak elsewhere than without dp: on the last stage as the LM
//! head's, then the last layer's down projection's, gradient joins its sum beside its unreduced
//! copy (the logits, their gradient and the final norm's output freed by then; before it, as the
//! head's gradient is made beside the logits' gradient, where tp splits the head), and on any stage as
//! the last layer's gate output gradient is made beside the SiLU product's (the down gradient
//! reduced and summed); inside the first layer as the gate's gradient joins its sum, the MLP norm
//! output's gradients summed, and on a stage but the first as the attention norm output's gradient
//! from q joins those from k and v, q's weight gradient not yet made. cp reduces as dp does.

//! Under tp (without SP) each rank keeps its heads' and ffn channels' share of the activations and
//! of the LM head's logits, and on the first stage the embedding's gradient over the whole
//! vocabulary is live at the tail, as the rank's rows are sliced from it into their sum.
//!
//! Megatron SP splits the residual stream on seq over tp; the norms' outputs (and their gradients)
//! are kept all-gathered, and the last layer's output is gathered whole for the final norm.
//! Selective recomputation keeps no attention output; full recomputation keeps each layer's
//! attention residual and output, and recomputes the final norm's (gathered) input and output.
//!
//! Under cp each rank keeps its zigzag share of the tokens' activations but every token's k and v
//! (all-gathered; recomputed so under recomputation, and kept so for zero bubble's W), the last
//! stage every token's logits (over its tp shard of the vocabulary), and the gradients are
//! all-reduced as under dp. Beside tp under SP each cp rank's tokens are split over tp, as without
//! cp: the stream between layers is split on seq over cp × tp.
//!
//! Under tsp each rank keeps its share of the tokens' activations as under cp, and per attention
//! owner its q, output and every token's k and v; the MLP ring keeps nothing (its backward
//! recomputes from the norm's output). The embeddings are sharded, the first stage's tail holds the
//! whole-vocabulary embedding gradient with every token's ids, and the last stage keeps the head's
//! input gathered over the sequence and every token's logits. A stage's ranks may peak inside its
//! first layer's attention backward, each at its own point: the backward takes the owners last
//! first, so a rank peaks as o's weight gradient is reduced to it, beside its contributions to its
//! block, the owners' results before it and the activations of the owners after it (more on each
//! later place on the axis); the axis's last rank, whose owner goes first, as o's gradient joins
//! its sum; any rank also as o's reduce to another owner leaves zeros there, beside the activations
//! of the owners after that one (the point where the axis's last rank peaks beside dp, which
//! all-reduces o's gradient before it joins its sum), and as it is reduced to the first owner (on
//! the axis's last rank itself), none summed before it, every other owner's activations after it;
//! outside zero bubble any rank also as an owner's attention kernel makes v's gradient, beside
//! that owner's q, k and v (recomputed under full recomputation, their blocks broadcast again) and
//! the kernel's other gradients, then as that owner's q input gradient is made from q's block
//! broadcast again, and as it joins the attention norm output's gradient, q's block freed: the
//! last owner's (its RoPE backwards done, the earlier owners' results summed), the first owner's
//! (every other owner's activations still live, none summed) or one between them. Under ZeRO-3
//! every rank passes its own attention blocks, gathered over its replicas again, to each owner's
//! broadcasts: each is gathered at its first broadcast, in the first owner's backward, and freed
//! after its last, the last owner's (outside zero bubble; under full recomputation the attention
//! norm's weight too, gathered to recompute its output, to the norm's backward). Beside dp
//! the first stage's other candidate is the embedding rows' slicing, as under dp × tp. The closed
//! form takes the rank's place on the axis. On more tokens a stage peaks inside an MLP ring's
//! backward (`tsp_ring`, step by step: each step recomputes gate and up with the shard it holds,
//! makes their gradients, the shard's weight-gradient contributions, joined to the partial gradient
//! that travels with the shard, and the input gradient's parts, summed as they come): its last
//! layer's, at the head of the backward (on the last chunk after the head's gradients; under full
//! recomputation beside the ring's input, recomputed); its first layer's, the later layers'
//! activations freed (and just past it, as the MLP norm's input gradient is summed). On the last
//! chunk it may peak as the LM head's weight gradient joins its sum beside every token's logits'
//! and head input's gradients (beside dp after its all-reduce, its unreduced copy live), or under
//! full recomputation as the final norm's output is recomputed and gathered over the sequence for
//! it, and as the gradient joins its sum beside that (beside dp after its all-reduce, that copy
//! freed). Under zero bubble B runs the MLP ring's backward whole, its weight gradients too
//! (splitting it would run the ring twice): a micro-batch between B and W keeps the ring's weight
//! gradients instead of what they read, W reads only the attention's; the stage may peak inside a
//! B's first layer's ring, or its attention backward (the input gradients; under full recomputation
//! B recomputes every owner's q, k and v, which W reads) as the last owner's part of the input
//! gradient is summed (without recomputation also the first owner's k part, and under ZeRO-3 its
//! q part, every other owner's q, k and v live), in a forward's last layer's ring or as the last
//! chunk makes every token's logits, as the first stage's B gathers the embedding output's
//! gradient over the sequence (W reads every token's), as the last stage's B reduce-scatters the
//! LM head's input gradient over it, or at the head of the last chunk's W (the LM head's
//! gradient). Beside dp the last chunk may
//! also peak as the LM head's weight gradient is made (beside the logits' and the head input's
//! gradients), and the first stage as its whole-vocabulary embedding gradient is scattered from
//! every token's gradient (gathered, both orders of the token ids live). Under ZeRO-2 and 3 the
//! sums and gradients are dp's shards: the LM head's gradient is reduce-scattered, staged whole
//! (under zero bubble in W), the ring's three at the ring's end; ZeRO-3 gathers the rank's shards
//! of a layer's MLP weights over dp again for its ring's backward (under full recomputation the
//! MLP norm's and the final norm's weights too).
//!
//! A mixture of experts (every expert on every rank, or over ep E/ep of them) keeps no MLP
//! activations (its backward recomputes the routed experts' from the MLP norm's output), and may
//! peak inside its first layer's backward instead of at the tail, as one of that layer's
//! routed-expert gradients (an `[E, h, f_e]` matrix) joins its sum beside the layer's attention
//! activations: the last of the three, or under dp the first, the other two waiting unreduced. Its
//! load-balancing loss keeps each layer's expert counts and router probability sums on the stages
//! but the last (sent on) and their counts' sum on the last, to each micro-batch's end, the loss
//! itself until the backward starts. The last stage sends that sum back to every other in its
//! forward, for their router probabilities' backward: the stage next to it takes those on its
//! gradients' link in the order they were sent, so under GPipe it holds them for the micro-batches
//! in flight too. Under interleaving every micro-batch holds the sum it received to its end on the
//! stage (each chunk's routers read it), and the last stage's other chunks hand their layers'
//! statistics to its last chunk on the same rank instead of sending them on; every other stage
//! sends its chunks' statistics to that last chunk, and the last stage holds those it took off a
//! link before the last chunk's forward reads them (`incoming_link`): the stage before's come
//! with its outputs (under SP its chunk's last layer's after the output, so with the next one),
//! the first stage's with the input gradients it sends the last stage. (A stage between the
//! first and the last holds the counts' sum it received through its first layer's backward.)
//! Under zero bubble B
//! runs the experts' and the router's backward, their weight gradients too (none is a W op): a
//! micro-batch between B and W keeps those gradients, W reads only the attention's inputs and the
//! norms', and a stage may peak inside a B, as its first layer's last expert gradient joins its sum
//! beside the micro-batches between B and W (beside dp or cp the first, reduced while the other
//! two wait unreduced, as outside zero bubble; under tp also as its first layer's experts' input
//! gradient is all-reduced). The received counts' sum is freed after its last
//! reader on the first stage (where the program's free lies) and at the micro-batch's end on the
//! others. Over ep the dense gradients are all-reduced over it as over dp, and the experts' (which
//! ep splits) are not; one instruction makes the experts' input, router and weight gradients, the
//! router's input and weight gradients from the load-balancing loss waiting beside it. Over ep
//! beside tsp, which then keeps the experts whole (each tsp rank runs its own tokens through the
//! rank's share over ep), the experts' and the router's gradients are partial sums over tsp: each
//! is all-reduced over it before it joins its sum, as over dp, the MLP norm's output (and under
//! ZeRO-3 the router's weight gathered again) freed first. Under
//! Megatron SP the experts read the output gradient all-gathered over tp (but beside dp, where it
//! is freed with the MLP norm's output before the all-reduce). Under
//! full recomputation beside dp, cp or ep the last stage all-reduces the counts' sum over them
//! again in each backward and sends that, so no stage holds it for a micro-batch whose backward
//! has not started. A micro-batch in flight on the last stage holds its cross-entropy and its
//! load-balancing loss apart, summed into its loss by the loss's backward.
//!
//! Under ZeRO-2 and 3 a mixture's stage holds its gradients' shards (a dense one's over dp × cp ×
//! ep, a routed expert's over dp × cp: over ep alone ZeRO does not shard the experts, nor where
//! their rows do not divide over dp and cp, when they are all-reduced as beside dp), and each
//! gradient is reduce-scattered where dp would all-reduce it, staged whole: the routed experts'
//! three, made at once (a stage may peak as the last is made, the MLP norm's output and under SP
//! the output gradient gathered still live), the MLP norm's output freed before the first is
//! scattered (under ZeRO-2
//! after the router's gradient, under ZeRO-3 before it, the router's gradient whole until then;
//! beside ep the router's gradients from the load-balancing loss summed first), and a shared
//! expert's one by one, each as dp's all-reduce would be, its shard joining its sum after. Under
//! ZeRO-3 the experts' backward gathers the router's and the experts' weights again, live from
//! their input gradient (all-reduced over tp) to their last weight gradient, where a stage peaks
//! on more tokens (over ep beside the dispatch's copy of its operands); under full recomputation
//! the MLP norm's weight too, and the shared expert's gate and up weights to their input
//! gradients. Under zero bubble these points are B's, where the experts' gradients are made (a
//! shared expert's gate gradient is scattered in W), the sums of the experts' gradients not yet
//! made on a micro-batch's first B of the chunk; over ep B may peak as it dispatches its first
//! layer's experts' backward. Under ZeRO-3 B may also peak as a shared expert's down input
//! gradient is made beside its weights gathered again, and under full recomputation, where a
//! dense weight split over several of dp, cp and ep is gathered a step an axis, as the recomputed
//! forward's last step gathers them, the step before's output beside the whole.
//!
//! A shared expert (Qwen2-MoE) is a dense gated MLP beside the routed experts: a micro-batch in
//! flight keeps its gate, up, product, output and gate logit, and its backward comes before the
//! routed experts' (and the router's), so a stage may also peak as its first layer's shared gate
//! projection gradient, the last of its three, joins its sum, the MLP norm output the routed
//! experts still read and its gradient live, the gradient's unreduced copy beside it over dp, cp or
//! ep (its replicas). Over ep, where the routed experts' gradients are a rank's share, that point
//! is above theirs. Under zero bubble its weight gradients (its gate vector's too) are W's: a
//! micro-batch between B and W keeps what they read (the MLP norm's output, to its end since B
//! reads it too, and the product) and their output gradients, and the gate gradient joins its sum
//! in the first layer's W, beside the attention inputs and gradients W reads next.
//!
//! On more tokens a mixture's activations outweigh its gradients and a stage peaks inside a
//! backward (under zero bubble see below). At the head of a chunk's backward (`head`), all
//! that the micro-batch holds in flight live: as the two parts of the output gradient the next
//! stage sent back are summed; in the last layer's shared expert's backward (`shared_expert`: its
//! down gradient made and joining its sum, up's output gradient made, gate's gradient joining its
//! sum; under tsp inside its ring, step by step, `tsp_ring`, and as the ring's input gradient
//! joins the gate vector's); as the routed experts' backward is dispatched over ep (from a copy
//! of its operands) or their input gradient all-reduced over tp (without ep; a shared expert's
//! gradients made); as an
//! expert gradient joins its sum; as the MLP norm output's gradients from the router (or a shared
//! expert) and the experts are summed (over ep after the dispatch, beside the load-balancing loss;
//! without ep before the experts' weight gradients, under ZeRO-3 their weights still gathered);
//! and as the attention residual's gradient is summed past the MLP norm's backward; on the last
//! chunk (not beside cp) also as the LM head's weight gradient is made (beside dp, before its
//! all-reduce) or joins its sum. Inside the first layer's backward: the same points of its MLP
//! backward beside the layer's attention activations, its attention kernel's backward, and (not
//! beside cp) the attention norm output's gradients from v and k summed, then from q. Under full
//! recomputation the head's points are modelled beside the MLP norm's output recomputed (and a
//! shared expert's gate, up and product), and so are the last layer's attention kernel's backward
//! and input gradients, the layers below holding their residual stream (outside it too, the
//! attention's inputs kept, where tp splits the MLP finer than the hidden size). Over ep beside the
//! load-balancing loss the router's gradient from the experts' backward has no running sum until it
//! is summed with its gradient from the loss. `tests/cost_training.rs` checks the form exact to
//! 1024 tokens beside dp, cp, ep and tp, each recomputation, outside zero bubble; under zero bubble
//! below on 1 stage in 100 (within 3%), never above.
//!
//! Under dp × tp the whole-vocabulary gradient is freed once the rank's rows are sliced from it,
//! before their all-reduce; the first stage's other candidate is that moment (the whole gradient
//! and the rows, not yet reduced nor summed), the larger where tp > 2.
//!
//! Beside a tied table the last stage receives the first stage's table once a step (a buffer to
//! the program, a parameter to Megatron's accounting: [`TIED_TABLE_RECEIVED`]) and makes, at the
//! head of each micro-batch's backward, the head's part of the table's gradient, which joins no
//! sum there: it is sent back and held to the micro-batch's end ([`TIED_HEAD_PART`]), so the
//! stage may next peak as its last layer's down gradient joins its sum. Beside dp × tp the last
//! stage reduces it over dp at the end of its backward, another point, and sends it after the
//! input gradient. The first stage takes it off its link from the last stage as a step reads it
//! or a message queued after it (`head_link`: under interleaving a later forward's input, on two
//! stages an input gradient), and holds it from there; the first chunk's backward, which reads it,
//! takes it at the latest, and with it any messages queued ahead, held to the steps reading them.
//! A mixture's counts' sums come on the same link, so a step taking a head's part takes the sums
//! the last stage sent before it too, held until the backward (zero bubble: B) reading each. Of a
//! mixture the head's part is held, not summed, through its last layer's MLP backward, and under
//! zero bubble the first stage's W may peak at its head, as the last layer's MLP norm weight
//! gradient (under tsp a shared expert's gate vector's first) joins its sum beside the part taken.
//! It adds it to the embedding's part: at the
//! tail both parts are live beside their sum (the token ids and the embedding output's gradient
//! freed), and the rows are sliced from the whole vocabulary's gradient under tp beside the head's
//! part; beside dp (or cp) without tp the two parts and their sum are live before the sum is
//! reduced (under ZeRO-2 more than at the reduce-scatter after). Under ZeRO-3 the last stage
//! receives the table's dp shard and gathers it itself, in its forward and again in its backward
//! (`pipeline::gather_params_on_each_stage`); those copies are freed by the points modelled, but
//! over dp and cp both, where it is gathered in two steps: the stage may peak as the last runs
//! for the head's backward, the step before's output beside it. Under zero bubble the head's part
//! is made in the last stage's W (which then makes the final norm's and the last layer's MLP
//! weight gradients, the part held) and, beside dp × tp, reduced over dp at the W's end; it is
//! added in the first stage's W, which on two stages takes, before it, the input gradients the
//! last sent from the B steps it ran in between.
//!
//! Under Megatron's interleaving each stage holds `v` chunks of equal layers, chunk `c` of stage `s`
//! being virtual stage `c·p + s`, each with its own running sums and in-flight micro-batches; a
//! micro-batch's positions are loaded once a stage. A micro-batch's gradients are outputs of its
//! program, so a chunk's stay until the micro-batch's backward is done on every chunk of the
//! stage, and so do the buffers another rank reads last (the output sent on, the input's gradient
//! sent back, the attention norm's input gradient) and, on the last chunk, the targets and loss.
//!
//! Under zero bubble (ZB-H1) the tail is a W's (the weight gradients' part of a backward): a
//! micro-batch whose B is done and W not yet keeps what its weight gradients read, and the residual
//! gradients, which B reads too, stay to the micro-batch's end. Under full recomputation B
//! recomputes each layer's forward, and what W reads of it (q, k, v, gate and up, the norms'
//! outputs) stays with the gradients W reads until W, beside the residual stream the forward kept.
//! Those micro-batches hold more than one in flight does, so on more tokens a stage peaks beside
//! them at other steps too, each modelled (`walk` weighs B's, W's and the forwards' points): in a
//! B, inside its first layer's backward (a shared expert's, as gate's output gradient is made; a
//! mixture's expert gradient joining its sum; the attention kernel's backward; the attention norm
//! output's gradients from v, k and q summed, each projection's gradient kept for W, under SP o's
//! output gradient gathered over tp too; under full recomputation beside what B recomputed, under
//! ZeRO-3 the weights it gathered again for that), the B gradients made so far and their sums
//! beside it, and on the last chunk at its head, as the loss's backward makes the logits' gradient
//! beside all the forward kept (none of what W reads made yet); at the head of a W, as its first
//! weight gradient (the LM head's on the last chunk, after the micro-batch's two losses are summed,
//! or beside a tied table the head's part of it; the last layer's down projection's, dense or a
//! shared expert's, on another; a mixture's o projection's there, after a shared expert's, its
//! router's and experts' being B's, its MLP norm's before it) is made or joins its sum, all the
//! micro-batch held between B and W still live (under ZeRO-2 and 3 also as it is reduce-scattered,
//! staged whole, what made it freed, and a dense MLP's up gradient after it), as a dense chunk's
//! first layer's gate gradient joins its sum, its attention's weight gradients still to come, and
//! on a mixture's chunk of more than one layer (outside SP) as its last layer's q gradient joins
//! its sum (beside replicas as it is made); and in a forward (tied table or
//! not), at its last layer's MLP (its output made; a mixture's routed experts run, dispatched over
//! ep or tsp or as one kernel, under ZeRO-3 beside their weights gathered; under SP as the MLP's
//! output is reduce-scattered over tp,
//! without SP as a mixture's routed experts' output is all-reduced over it;
//! under full recomputation as a dense MLP's up output is made beside the MLP norm's output, gate's
//! output and, under ZeRO-3, up's weight gathered, and as its SiLU product is made beside gate and
//! up, and on the last chunk under SP as the final norm runs on the last layer's output gathered
//! over tp; a shared
//! expert's and the routed experts' outputs summed; under full recomputation the shared expert's
//! product, its down projection's output and its scaled output made) beside all the micro-batch
//! keeps, under full recomputation beside cp at its last layer's attention (every token's k and v
//! gathered), without cp or tsp as its v projection runs (under ZeRO-3 beside v's weight
//! gathered; outweighing the points after it where a mixture's experts are not gathered), and
//! beside cp as the last chunk gathers every token's logits (without cp, a
//! mixture's outside SP, as it makes them; under ZeRO-2 and 3 beside the running sums' shards,
//! and those kept whole). A micro-batch's loss joins
//! the loss's sum in W beside dp, cp or ep or the load-balancing loss, else in B; the first stage's
//! B frees the positions (but where W recomputes). `tests/cost_training.rs` checks the form from 64
//! to 1024 tokens never above the planner's peak and within 3% (mixtures; 1% beside a shared expert
//! under SP, 2% under ZeRO-2 and 3) or 4% (dense stages, tied or not; 1% under ZeRO-2 and 3 over dp
//! or cp) below it, exact on most stages; the points left are W's later ones, a tied mixture's
//! tails under SP on few tokens, and under SP with ZeRO-3 a mixture's forward beside its router
//! gathered. Under tsp B runs the MLP rings' backward whole (on a chunk but the
//! last it begins with its last layer's ring) and W takes the layers last to first, so W may peak
//! in its last layer's attention too, as o's gradient is reduced to an owner, what W reads of the
//! layers before still live: there the form is within 1% below, exact on nine stages in ten, and
//! under zero bubble beside dp alone exact on every stage.
//!
//! A mixture's routed experts split over tsp are dispatched over it as over ep (one instruction
//! makes the layer's expert, router and input gradients), but the tokens are the sequence's share:
//! the dense gradients are the rank's attention blocks (the router's and the norms' all-reduced
//! over the axis, the router's two summed first, past the dispatch), and the counts' sum is
//! all-reduced over it, so that under full recomputation the last stage sends it again in each
//! backward; under full recomputation a chunk of more than one layer may peak in its last layer's
//! attention kernel backward too, the residual stream of the layers below live. A shared expert
//! beside them is a ring MLP, as a dense layer's: its forward keeps only its output and gate
//! logit, and its backward's points are the ring's, step by step (`shared_expert`, `tsp_ring`).
//! Under zero bubble B runs that ring whole (its projections' gradients are B's), and W reads
//! only the gate logit's gradient and the MLP norm's output for the gate vector's weight gradient,
//! that output staying to the micro-batch's end; a forward may peak inside the last layer's shared
//! expert ring, after the routed experts' dispatch (under ZeRO-3 beside the ring's weights,
//! gathered over dp for it, as a dense layer's ring in a forward).
//!
//! Modelled: `pp`, alone or with any of `dp`, `tp` (with or without SP) and `cp`, or with `tsp`
//! alone or beside `dp` (any ZeRO stage; a mixture's experts split over tsp, with or without a
//! shared expert); GPipe, 1F1B, interleaved
//! 1F1B and zero-bubble H1, with
//! any recomputation;
//! ZeRO-1 anywhere (it splits only the optimizer's state, which the programs do not hold: they are
//! dp's), and ZeRO-2 and 3 on a mesh without replicas (they split nothing); ZeRO-2 over dp, cp or
//! both (whose ranks hold the same weights), with or without tp (±SP), where no parameter's rows
//! divide over them (every gradient all-reduced and kept whole, no weight gathered: ZeRO-1's
//! programs, as at dp=3 on `tiny`), or
//! where every parameter's rows divide over them but perhaps q's, k's and v's, a mixture's
//! router's and routed experts', or the vocabulary tables' (split over some of their replicas or
//! none of them; the sums and
//! gradients are their shards, each gradient is reduce-scattered and staged whole, and the stage's
//! other candidates are inside its first layer's backward, or W, as the gate gradient is scattered
//! (but under tsp, whose ring makes the MLP's gradients) and, on a chunk of two layers or more,
//! the down and up gradients, and at a backward's head as the last layer's down and up gradients
//! are; q, k and v, where ZeRO keeps them whole, are named apart,
//! [`super::compiled_training::GRADS_KEPT_WHOLE`], none of a chunk's made at the head of its
//! backward or of its W, v's before k's before q's in a layer's attention backward
//! (`chunk::KeptWholePending`); where it keeps q whole, a chunk's tail all-reduces q's gradient in
//! place and it joins its sum whole, as beside dp alone: at pp=2 × dp=8 × tp=2 on `tiny`, or
//! wherever tp or tsp leaves fewer heads a rank than dp's degree; where it keeps the router or
//! the routed experts whole, as Mixtral's 8 experts at dp=16, their gradients are all-reduced
//! and join their sums whole, as beside dp without ZeRO, so that a stage may peak as the experts'
//! three are made before their all-reduces, and where it splits them over fewer replicas (six
//! experts' router at dp=2 × ep=2 over dp alone, reduce-scattered over it and all-reduced over
//! ep) their shards are those replicas'; the sums and gradients count them as held rather than
//! name them apart); where it keeps the embedding whole (250 rows at dp=4), or an untied LM
//! head, their gradients are all-reduced and join their sums whole as beside dp alone (the
//! embedding's at the first chunk's tail, the head's at the last chunk's head, before the
//! all-reduce none of it made), named apart as q's, k's and v's are, and where it splits them
//! (or q) over some of their replicas (dp's, not cp's or ep's), the tail reduce-scatters the
//! joining gradient over those and then all-reduces the shard over the rest. ZeRO-2 and 3 where a
//! dense parameter's rows do not divide (o, a norm, the MLP or a shared expert: 130 wide at dp=4,
//! 258 channels at dp=4, 129 a rank beside tp or tsp at dp=2): its gradient is all-reduced and
//! summed whole, and the form counts it whole in the running sums and in what a micro-batch has
//! made (`chunk::KeptWholePending`), but as not yet made anywhere inside the layer a point lies
//! in (its MLP's and o's, made before the attention's points, are missed there), nor the final
//! norm's; ZeRO-3 keeps those weights whole and gathers none of them, and the form gathers only
//! the o, MLP and norm weights whose rows divide. Never above the planner, within 8% below (14%
//! beside tsp, under zero bubble), where the program peaks as a layer's MLP gradients are made
//! and reduced. ZeRO-3 as ZeRO-2 with the
//! parameters their shards too (each layer's gathered weights are freed by then; under full
//! recomputation the first layer's are gathered again for its recomputed forward, and the stage's
//! other candidates are inside that layer's backward, as its down and output projections'
//! gradients are scattered beside the weights they were recomputed with, but under zero bubble,
//! where B regathers them and W reads none; q, k and v, a router and routed experts, and the
//! vocabulary tables kept whole are [`super::compiled_training::PARAMS_KEPT_WHOLE`], never
//! gathered, a tied table received whole by the last stage); a Llama-family model,
//! dense, or a mixture of experts (with or without a shared expert) with every expert on every
//! rank or split over ep, beside dp, cp, ep and tp (with SP), any ZeRO stage; its embedding untied, or tied (dense or a mixture; with or without tsp: under tsp the
//! head's part of the table's gradient joins no sum as it is made, beside dp reduced at the end of
//! the backward as beside dp × tp; the first stage's scattering of the embedding's gradient holds
//! it beside both orders' token ids; under
//! zero bubble W makes it, so B's points on the last stage do not hold it, and the first stage's W
//! begins, with its last layer's MLP norm weight gradient, holding it once taken).
//! [`pipelined_differences_from_closed_form`] names
//! the terms by which [`super::memory`]'s stage peak (1F1B's in-flight activations by Korthikanti's
//! formulas) differs from it; `tests/cost_training.rs` checks that closed form plus those terms
//! equals the planner's peak to the byte on every stage.
//!
//! The form is built in parts: `chunk` holds what one chunk of the stage keeps (a micro-batch in
//! flight, what stays to its end, the tail of a backward), `head` and `first_layer` the points
//! at the head of a backward and inside its first layer's, `experts` and `shared_expert` a
//! mixture's MLP backward's points at either place, `zero_bubble` what a micro-batch holds
//! between its B and its W (and the head of its W), `forward` the points of a forward under zero
//! bubble, `tsp_ring` the points inside a tsp MLP ring, `link` which step takes each message of
//! a link between stages, `head_link` what the first stage takes early from the stage holding a
//! tied LM head, `incoming_link` the positions (beside cp or tsp) and a mixture's statistics a
//! later stage takes early from the first stage and the one before, and `walk` weighs every
//! point of every step of the stage's schedule beside what the other micro-batches hold there.
mod chunk;
mod experts;
mod first_layer;
mod forward;
mod head;
mod head_link;
mod incoming_link;
mod link;
mod replicated_key_values;
mod shared_expert;
mod tsp_ring;
mod walk;
mod zero_bubble;

use pleat_ir::AxisName;

use super::activation::key_values_replicated;
use super::compiled::ForwardPhase;
use super::compiled_training::PARAMS_KEPT_WHOLE;
use super::layout::Layout;
use super::memory::{MemoryBreakdown, Term};
use super::model::ModelShape;
use super::step_sizes::StepSizes;
use super::workload::{Recompute, Workload};
use super::zero_rows::ZeroRows;
use crate::pipeline::{Schedule, ScheduleKind};
use chunk::{ChunkHold, KeptWholePending};

/// The peak of the rank at `tsp_rank` on the tsp axis (0 without one) of stage `stage` (holding
/// `layers` layers) of `schedule` for `model` on `layout`, `workload` one micro-batch
/// (`micro_batch` sequences of `seq`), elements of the model's dtype; `None` outside what is
/// modelled (see the module doc). The phase's `params` are the stage's; its terms name every other
/// buffer live at the peak. (Under tsp a stage's ranks peak apart, each as its own block's
/// gradients are reduced to it, beside the activations of the owners whose backward follows.)
pub fn compiled_stage_peak(
    model: &ModelShape,
    layout: &Layout,
    workload: &Workload,
    schedule: &Schedule,
    stage: u32,
    tsp_rank: u64,
    layers: u64,
) -> Option<ForwardPhase> {
    // (Which of the rank's parameters ZeRO splits: read by what is modelled and by the stage.)
    let zero_rows = ZeroRows::new(model, layout);
    if !modelled(layout, workload, schedule, tsp_rank) {
        return None;
    }
    // Chunk c of stage s is virtual stage c·p + s (Megatron's interleaving), of equal layers.
    let chunks = schedule.kind.chunks();
    if layers % u64::from(chunks) != 0 {
        return None;
    }
    // tsp's programs shard the embeddings over it. Where ZeRO splits no parameter, ZeRO-2 and 3
    // compile to ZeRO-1's programs: every gradient all-reduced whole, no weight gathered.
    let tsp = layout.degree(AxisName::Tsp);
    let splits_none = workload.zero >= 2 && layout.zero_replicas() > 1 && !zero_rows.splits_any();
    let zero = if splits_none { 1 } else { workload.zero };
    let kept_whole_zero3 = splits_none && workload.zero >= 3;
    let workload =
        &Workload { tsp_shards_embeddings: workload.tsp_shards_embeddings || tsp > 1, zero, ..workload.clone() };
    let shape = StageShape::new(model, layout, &zero_rows, workload, schedule, stage, tsp_rank);
    let virtual_stages = schedule.stages * chunks;
    let holds: Vec<ChunkHold> = (0..chunks)
        .map(|chunk| {
            let virtual_stage = chunk * schedule.stages + stage;
            chunk::chunk_hold(
                &shape,
                virtual_stage == 0,
                virtual_stage + 1 == virtual_stages,
                layers / u64::from(chunks),
            )
        })
        .collect();
    // ZeRO-3 keeps the rank's shard of the stage's parameters (a dense one's over dp × cp × ep, a
    // routed expert's over dp × cp); each layer's gathered weights are freed by the points
    // modelled here.
    let replicas = layout.zero_replicas();
    let param_shards = if workload.zero >= 3 && replicas > 1 { replicas as f64 } else { 1.0 };
    let params = holds.iter().map(|hold| hold.params).sum::<f64>();
    let experts = layers as f64 * shape.layer_routed_experts();
    let params = if param_shards > 1.0 {
        sharded_over(params, experts, param_shards, layout.expert_zero_replicas() as f64)
    } else {
        params
    };
    let mut phase = walk::stage_peak(&shape, schedule, &holds, params)?;
    // Every point holds the q, k and v projections ZeRO-3 keeps whole beyond their shards (where it
    // splits no parameter, all of them: the closed form's shards are the phase's parameters).
    if kept_whole_zero3 {
        let replicas = (layout.zero_replicas() as f64, layout.expert_zero_replicas() as f64);
        let shards = sharded_over(phase.params, experts, replicas.0, replicas.1);
        phase.terms.insert(0, Term { name: PARAMS_KEPT_WHOLE, bytes: phase.params - shards });
        phase.params = shards;
    } else if workload.zero >= 3 {
        // (And the chunks' vocabulary tables: the embedding on the first, an untied head on the
        // last.)
        let tables: f64 = holds.iter().map(|hold| hold.table_kept_whole).sum();
        // (And the final norm, on the last stage, where its rows do not divide.)
        let final_norm = if stage + 1 == schedule.stages { zero_rows.beyond_final_norm() } else { 0.0 };
        let bytes = layers as f64 * shape.layer_params_kept_whole() + tables + final_norm * shape.sizes.element;
        if bytes > 0.0 {
            phase.terms.insert(0, Term { name: PARAMS_KEPT_WHOLE, bytes });
        }
    }
    // (Under ZeRO-3 the stage receives the rank's shard of a tied table, over the replicas its rows
    // split over, and gathers it itself.)
    let received_whole = holds.iter().map(|hold| hold.received_table).sum::<f64>();
    let table_replicas = if param_shards > 1.0 { zero_rows.vocabulary_table_replicas() as f64 } else { 1.0 };
    let received_table = received_whole / table_replicas;
    if received_table > 0.0 {
        // Received in the stage's first forward, held to the end of the step. (Under ZeRO-3 the
        // rank's dp × cp shard of it, gathered by the stage itself for its head; where ZeRO keeps
        // the table whole, or splits nothing, whole: the closed form's shard and the rest beyond.)
        let shard = if kept_whole_zero3 || param_shards > 1.0 {
            received_whole / layout.zero_replicas() as f64
        } else {
            received_table
        };
        phase.terms.push(Term { name: TIED_TABLE_RECEIVED, bytes: shard });
        if received_table > shard {
            phase.terms.push(Term { name: TIED_TABLE_RECEIVED_BEYOND_SHARD, bytes: received_table - shard });
        }
    }
    Some(phase)
}

/// The term naming the head's part of a tied table's gradient: held by the stage holding the LM
/// head from its making to the micro-batch's end (sent back), and by the first stage from the
/// start of the micro-batch's backward until it is added to the embedding's part.
pub const TIED_HEAD_PART: &str = "the LM head's part of the tied table's gradient (sent back to the first stage)";

/// The term naming the head's parts of a tied table's gradient that the first stage took before
/// the step reading them: with a message queued after them that an earlier step reads.
pub const TIED_HEAD_PARTS_TAKEN_AHEAD: &str =
    "the head's parts of the tied table's gradient taken ahead of their reader";

/// The term naming the copy of a tied embedding table that the stage holding the LM head
/// receives from the first stage once a step: Megatron's accounting counts it a parameter, the
/// program a buffer received.
pub const TIED_TABLE_RECEIVED: &str = "the tied embedding table, received from the first stage for the LM head";

/// Of `bytes` of parameters or gradients, `experts` of them routed experts', the rank's shards:
/// the dense ones' over `shards` replicas, the experts' over `expert_shards`.
fn sharded_over(bytes: f64, experts: f64, shards: f64, expert_shards: f64) -> f64 {
    (bytes - experts) / shards + experts / expert_shards
}

/// The term naming, where ZeRO-3 keeps the tied table whole (or splits no parameter), the rest of
/// it the stage holding the LM head receives whole, beyond the shard of it Megatron's accounting
/// counts.
pub const TIED_TABLE_RECEIVED_BEYOND_SHARD: &str =
    "the received tied embedding table beyond its ZeRO-3 shard (ZeRO keeps the table whole here)";

/// Whether [`compiled_stage_peak`] models `model` on `layout` (whose ranks' parameters ZeRO splits
/// as `zero_rows` says) under `workload` and `schedule` (see the module doc).
fn modelled(layout: &Layout, workload: &Workload, schedule: &Schedule, tsp_rank: u64) -> bool {
    let stages = schedule.stages;
    let (tp, cp) = (layout.degree(AxisName::Tp), layout.degree(AxisName::Cp));
    let tsp = layout.degree(AxisName::Tsp);
    layout.degree(AxisName::Pp) == u64::from(stages)
        && layout.world_size() == u64::from(stages) * layout.batch_split() * tp * cp * tsp
        && stages >= 2
        // tsp beside pp, alone or with dp or ep (any ZeRO stage): a dense model, or a mixture
        // (its routed experts split over tsp, or over ep beside it), with or without a shared
        // expert.
        && tsp_rank < tsp
        && (tsp == 1 || tp * cp == 1)
        // ZeRO-2 and 3 over dp, cp or both (with or without tp), wherever the rows divide or not
        // (see the module doc).
        && workload.zero <= 3
}

/// Where in a chunk's backward a layer's points lie: in its first layer's (the attention's
/// activations live, every later layer's gradients made), or at the head of the chunk's backward,
/// in its last layer's (all that the micro-batch holds in flight live).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Place {
    FirstLayer,
    LastLayer,
}

/// What every chunk of a stage shares: the model and the step, the layout's degrees, one rank's
/// buffer sizes, and what the strategies make of them.
struct StageShape<'a> {
    model: &'a ModelShape,
    layout: &'a Layout,
    workload: &'a Workload,
    sizes: StepSizes,
    tp: u64,
    cp: u64,
    tsp: u64,
    ep: u64,
    /// The rank's place on the tsp axis (0 without one).
    tsp_rank: u64,
    /// The stage, the schedule's stages, and its chunks a stage.
    stage: u32,
    stages: u32,
    chunks: u32,
    zero_bubble: bool,
    /// dp or cp (or for a dense parameter ep, which splits the batch as dp does) reduce each
    /// gradient before it joins its sum.
    reduced: bool,
    /// dp or cp reduce each routed expert's gradient before it joins its sum (ep splits them), and
    /// so does tsp beside ep (its ranks run their own tokens through the same experts).
    experts_reduced: bool,
    /// ZeRO-2 reduce-scatters each gradient over dp: the sums and the micro-batch's gradients are
    /// its shards (`shards` of them), and a gradient is whole (and staged whole) only while it is
    /// scattered.
    scattered: bool,
    shards: f64,
    /// A routed expert's gradients are sharded over its own replicas, dp × cp (ep splits the
    /// experts), or those its rows divide over: `expert_shards` of them (1 where ZeRO does not
    /// shard them).
    expert_shards: f64,
    /// The bytes of a layer's k and v projections, of q's weight and of q's bias that ZeRO-2 and 3
    /// hold beyond their shards, where the rows do not divide over the replicas (of their
    /// gradients, and under ZeRO-3 of their weights too); and whether ZeRO-3 gathers k and v, and
    /// q (else it keeps them whole).
    key_values_kept_whole: f64,
    query_weight_kept_whole: f64,
    query_bias_kept_whole: f64,
    key_values_gathered: bool,
    query_gathered: bool,
    /// tp does not divide the kv heads: each tp rank holds all of k's and v's
    /// (`replicated_key_values`).
    key_values_replicated: bool,
    /// The bytes of a layer's router ZeRO-2 and 3 hold beyond its shard, where its `E` rows do not
    /// divide over the replicas (its gradient; under ZeRO-3 its weight too), and whether ZeRO-3
    /// gathers it (else it keeps it whole). (A rank's routed experts are held over the replicas
    /// their rows divide over, `expert_shards`: 1 where none does.)
    router_kept_whole: f64,
    router_gathered: bool,
    /// The bytes of a layer's dense parameters but q, k and v that ZeRO-2 and 3 hold beyond their
    /// shards where their rows do not divide over the replicas (their gradients, all-reduced as
    /// beside dp alone; under ZeRO-3 their weights too, never gathered): its attention norm's; its
    /// o's, MLP norm's (and a shared expert's gate vector's); and its MLP's (or shared expert's)
    /// down, up and (gated) gate projections', which its MLP backward makes first.
    attention_norm_kept_whole: f64,
    output_and_mlp_norm_kept_whole: f64,
    down_kept_whole: f64,
    up_kept_whole: f64,
    gate_kept_whole: f64,
    /// Whether ZeRO-3 gathers a layer's norms (and a shared expert's gate vector), its gate and up
    /// projections, its down projection and its o projection: where their rows do not divide
    /// over the replicas it keeps them whole and gathers nothing.
    norms_gathered: bool,
    gate_up_gathered: bool,
    down_gathered: bool,
    output_gathered: bool,
    /// The bytes of a vocabulary table (the embedding on the first chunk, an untied LM head on
    /// the last) ZeRO-2 and 3 hold beyond its shard, where its rows do not divide over the
    /// replicas (its gradient, all-reduced as beside dp alone; under ZeRO-3 its weight too), and
    /// whether ZeRO-3 gathers the tables (else it keeps them whole).
    table_kept_whole: f64,
    tables_gathered: bool,
    /// A mixture of experts' load-balancing loss: each layer's expert counts and router
    /// probability sums (`[E]` each), sent on to the last stage, which sums them over the layers
    /// (the counts' sum kept for the loss's backward, the loss itself until the backward starts).
    statistics: f64,
    /// The embedding is tied to the LM head: the stage holding the head reads the first stage's
    /// table and sends back the head's part of its gradient, which the first stage adds to the
    /// embedding's part before it joins its sum.
    tied: bool,
    /// A layer's attention weights and one norm's (elements), and one MLP projection's (bytes).
    attention_weights: f64,
    norm: f64,
    gate: f64,
}

impl<'a> StageShape<'a> {
    fn new(
        model: &'a ModelShape,
        layout: &'a Layout,
        zero_rows: &ZeroRows,
        workload: &'a Workload,
        schedule: &Schedule,
        stage: u32,
        tsp_rank: u64,
    ) -> StageShape<'a> {
        let (dp, tp, cp) = (layout.degree(AxisName::Dp), layout.degree(AxisName::Tp), layout.degree(AxisName::Cp));
        let (tsp, ep) = (layout.degree(AxisName::Tsp), layout.degree(AxisName::Ep));
        let sizes = StepSizes::new(model, layout, workload);
        let element = sizes.element;
        // ZeRO shards a dense gradient over dp × cp × ep, a routed expert's over dp × cp.
        let replicas = layout.zero_replicas();
        let scattered = workload.zero >= 2 && replicas > 1;
        let kept_whole = |elements: f64| if scattered { elements * element } else { 0.0 };
        // (The rank's q, k and v biases: its share of the heads, as its weights'.)
        let biases = if model.qkv_bias { sizes.query + 2.0 * sizes.kv } else { 0.0 };
        let mlp_projections = zero_rows.beyond_down() + zero_rows.beyond_up() + zero_rows.beyond_gate();
        StageShape {
            model,
            layout,
            workload,
            sizes,
            tp,
            cp,
            tsp,
            ep,
            tsp_rank,
            stage,
            stages: schedule.stages,
            chunks: schedule.kind.chunks(),
            zero_bubble: schedule.kind == ScheduleKind::ZeroBubbleH1,
            reduced: dp > 1 || cp > 1 || ep > 1,
            experts_reduced: dp > 1 || cp > 1 || (tsp > 1 && ep > 1),
            scattered,
            shards: if scattered { replicas as f64 } else { 1.0 },
            expert_shards: if scattered {
                zero_rows.routed_experts_replicas().unwrap_or(layout.expert_zero_replicas()) as f64
            } else {
                1.0
            },
            key_values_kept_whole: kept_whole(zero_rows.beyond_key_values()),
            query_weight_kept_whole: kept_whole(zero_rows.beyond_query_weight()),
            query_bias_kept_whole: kept_whole(zero_rows.beyond_query_bias()),
            key_values_gathered: zero_rows.splits_key_values(),
            query_gathered: zero_rows.splits_query(),
            key_values_replicated: key_values_replicated(model, layout),
            router_kept_whole: kept_whole(zero_rows.beyond_router()),
            router_gathered: zero_rows.router_replicas().is_some_and(|replicas| replicas > 1),
            attention_norm_kept_whole: kept_whole(zero_rows.beyond_attention_norm()),
            output_and_mlp_norm_kept_whole: kept_whole(zero_rows.beyond_dense_past_attention() - mlp_projections),
            down_kept_whole: kept_whole(zero_rows.beyond_down()),
            up_kept_whole: kept_whole(zero_rows.beyond_up()),
            gate_kept_whole: kept_whole(zero_rows.beyond_gate()),
            norms_gathered: zero_rows.splits_norms(),
            gate_up_gathered: zero_rows.splits_up(),
            down_gathered: zero_rows.splits_down(),
            output_gathered: zero_rows.splits_output(),
            table_kept_whole: kept_whole(zero_rows.beyond_vocabulary_table()),
            tables_gathered: zero_rows.vocabulary_table_replicas() > 1,
            statistics: sizes.statistics,
            tied: model.tied_embeddings,
            attention_weights: 2.0 * sizes.hidden * (sizes.query + sizes.kv) + biases,
            norm: model.norm.params(model.hidden) as f64,
            gate: sizes.hidden * sizes.ffn * element,
        }
    }

    /// The bytes of one layer's gradients (under ZeRO-3 also of its weights) that ZeRO-2 and 3
    /// keep whole beyond their shards.
    fn layer_kept_whole(&self) -> f64 {
        self.key_values_kept_whole
            + self.query_weight_kept_whole
            + self.query_bias_kept_whole
            + self.attention_norm_kept_whole
            + self.output_and_mlp_norm_kept_whole
            + self.down_kept_whole
            + self.up_kept_whole
            + self.gate_kept_whole
    }

    /// The bytes of one layer's weights ZeRO-3 keeps whole beyond their shards: q's, k's and v's,
    /// its norms, o and MLP (or shared expert), a mixture's router's and its routed experts'.
    fn layer_params_kept_whole(&self) -> f64 {
        self.layer_kept_whole() + self.router_kept_whole + self.routed_experts_kept_whole()
    }

    /// The bytes of one layer's routed experts on the rank that ZeRO-2 and 3 hold beyond their
    /// shards, whole or split over fewer replicas (0 where they divide over all, or there are
    /// none).
    fn routed_experts_kept_whole(&self) -> f64 {
        let replicas = self.layout.expert_zero_replicas() as f64;
        if self.scattered {
            let routed = self.layer_routed_experts();
            routed / self.expert_shards - routed / replicas
        } else {
            0.0
        }
    }

    /// The bytes of the gradients kept whole that a point of `hold`'s chunk has not made
    /// (`pending`).
    fn kept_whole_pending(&self, pending: KeptWholePending, hold: &ChunkHold) -> f64 {
        pending.key_values * self.key_values_kept_whole
            + pending.query_weights * self.query_weight_kept_whole
            + pending.query_biases * self.query_bias_kept_whole
            + pending.attention_norms * self.attention_norm_kept_whole
            + pending.outputs_and_mlp_norms * self.output_and_mlp_norm_kept_whole
            + pending.downs * self.down_kept_whole
            + pending.ups * self.up_kept_whole
            + pending.gates * self.gate_kept_whole
            + pending.table * hold.table_kept_whole
    }

    /// The bytes of a chunk's vocabulary table gradient (the embedding's on the first chunk, an
    /// untied LM head's on the last; under ZeRO-3 its weight too) that ZeRO-2 and 3 keep whole
    /// beyond its shard.
    fn chunk_table_kept_whole(&self, first: bool, last: bool) -> f64 {
        if first || (last && !self.tied) {
            self.table_kept_whole
        } else {
            0.0
        }
    }

    /// Whether ZeRO-2 and 3 reduce-scatter the LM head's (untied) weight gradient: else, where
    /// they keep it whole, it is all-reduced as beside dp alone.
    fn head_gradient_scattered(&self) -> bool {
        self.scattered && self.tables_gathered
    }

    /// The bytes of a layer's q weight that ZeRO-3 gathers again for a backward's recomputation or
    /// input gradient: none where it keeps q whole.
    fn query_weight_gathered_again(&self) -> f64 {
        let StepSizes { element, hidden, query, .. } = self.sizes;
        self.gathered_again_where(self.query_gathered, hidden * query * element)
    }

    /// The bytes of a layer's k and v weights that ZeRO-3 gathers again: none where it keeps them
    /// whole.
    fn key_value_weights_gathered_again(&self) -> f64 {
        let StepSizes { element, hidden, kv, .. } = self.sizes;
        self.gathered_again_where(self.key_values_gathered, 2.0 * hidden * kv * element)
    }

    /// The bytes of the rank's own tsp attention weight blocks among `blocks` that ZeRO-3 gathers
    /// again for the owners' broadcasts (but q's, or k's and v's, where it keeps them whole).
    fn tsp_blocks_gathered_again(&self, blocks: &[TspBlock]) -> f64 {
        let StepSizes { element, hidden, query, kv, .. } = self.sizes;
        let block = |width: f64| self.weights_gathered_again(hidden * width / self.tsp as f64 * element);
        blocks
            .iter()
            .map(|block_of| match block_of {
                TspBlock::Q if self.query_gathered => block(query),
                TspBlock::K | TspBlock::V if self.key_values_gathered => block(kv),
                TspBlock::O if self.output_gathered => block(query),
                _ => 0.0,
            })
            .sum()
    }

    /// The bytes of a layer's attention norm, q and k and v weights that ZeRO-3 gathers again (but
    /// those it keeps whole).
    fn attention_input_weights_gathered_again(&self) -> f64 {
        self.norms_gathered_again(self.norm * self.sizes.element)
            + self.query_weight_gathered_again()
            + self.key_value_weights_gathered_again()
    }

    fn recompute(&self) -> Recompute {
        self.workload.recompute
    }

    /// Whether Megatron SP splits the residual stream on seq over tp.
    fn sequence_parallel(&self) -> bool {
        self.sizes.sequence_parallel
    }

    /// The logits the last chunk keeps for the loss: over the rank's shard of the vocabulary, and
    /// under cp and tsp every token's (gathered back in order).
    fn logits(&self) -> f64 {
        let StepSizes { tokens, local_tokens, token_split, vocab_shard, element, .. } = self.sizes;
        let rows = if token_split > 1 { tokens } else { local_tokens };
        rows * vocab_shard * element
    }

    /// A mixture's load-balancing loss, the scalar the last chunk keeps beside the cross-entropy
    /// until the loss's backward sums the two (bytes; 0 without the loss's statistics).
    fn load_balancing_loss(&self) -> f64 {
        if self.statistics > 0.0 {
            self.sizes.element
        } else {
            0.0
        }
    }

    /// The rows of the logits the last chunk keeps for the loss (each over the rank's vocabulary
    /// shard).
    fn logit_rows(&self) -> f64 {
        self.logits() / self.sizes.vocab_shard / self.sizes.element
    }

    /// What a micro-batch in flight on the last chunk keeps of the final norm (bytes): nothing
    /// under full recomputation, which recomputes its input gathered under SP and its output;
    /// under tsp its output gathered over the sequence (the head's input); else its buffers
    /// beyond the last layer's output.
    fn final_norm_kept(&self) -> f64 {
        if self.recompute() == Recompute::Full {
            0.0
        } else if self.tsp > 1 {
            self.sizes.every_token
        } else {
            self.sizes.final_norm_buffers()
        }
    }

    /// The LM head's weight gradient that joins a running sum on the last chunk (bytes, the
    /// rank's rows): none beside a tied table, whose head's part is held and sent back instead.
    fn head_gradient_summed(&self) -> f64 {
        let StepSizes { element, vocab_shard, hidden, .. } = self.sizes;
        if self.tied {
            0.0
        } else {
            vocab_shard * hidden * element
        }
    }

    /// The head's part of a tied table's gradient, the rank's rows of it (bytes): made at the head
    /// of the last chunk's backward and sent back, received at the start of the first chunk's.
    fn tied_head_part(&self) -> Option<Term> {
        let StepSizes { element, vocab_shard, hidden, .. } = self.sizes;
        self.tied.then_some(Term { name: TIED_HEAD_PART, bytes: vocab_shard * hidden * element })
    }

    /// Whether a chunk sends its layers' load-balancing statistics on: under interleaving the
    /// last stage's other chunks hand theirs to its last chunk on the same rank instead, which
    /// frees them once it has summed them.
    fn statistics_sent_on(&self, last: bool) -> bool {
        !last && (self.chunks == 1 || self.stage + 1 < self.stages)
    }

    /// One layer's MLP gradients on the rank (bytes): a dense MLP's or a mixture's shared
    /// expert's projections (tp's or tsp's shard), the routed experts' (tp's and ep's or tsp's
    /// shard) and the routing parameters (whole).
    fn layer_mlp_gradients(&self) -> f64 {
        let model = self.model;
        (model.mlp_weights() as f64 / (self.tp * self.tsp) as f64 + model.router_params() as f64) * self.sizes.element
            + self.layer_routed_experts()
    }

    /// One layer's router weights (whole on every rank; bytes, 0 for a dense model).
    fn router(&self) -> f64 {
        self.model
            .experts
            .as_ref()
            .map_or(0.0, |experts| (experts.count * self.model.hidden) as f64 * self.sizes.element)
    }

    /// One layer's routed-expert weights on the rank, its tp and ep share (bytes; 0 for a dense
    /// model).
    fn layer_routed_experts(&self) -> f64 {
        self.model.routed_expert_weights() as f64 / (self.tp * self.layout.expert_degree()) as f64 * self.sizes.element
    }

    /// Of `bytes` of gradients (under ZeRO-3 of parameters too), `experts` of them routed
    /// experts', what the rank holds under ZeRO-2 and 3: a dense one's shard over dp × cp × ep, a
    /// routed expert's over dp × cp.
    fn sharded(&self, bytes: f64, experts: f64) -> f64 {
        sharded_over(bytes, experts, self.shards, self.expert_shards)
    }

    /// Whether the routed experts are split over ep or tsp, so that one instruction dispatches
    /// their backward (every gradient of it made at once).
    fn dispatched(&self) -> bool {
        self.layout.expert_degree() > 1
    }

    /// Whether ZeRO-2 and 3 shard the routed experts' gradients (over dp × cp, or those of them
    /// their rows divide over: not over ep alone, nor where none divides).
    fn experts_scattered(&self) -> bool {
        self.expert_shards > 1.0
    }

    /// The MLP's weight gradients B makes under zero bubble, a layer (bytes; as the rank holds
    /// them): a dense MLP's tsp ring's, or a mixture's experts' and router's (beside tsp too, and
    /// there a shared expert's ring's; not a shared expert's gate vector, whose weight gradient is
    /// W's); none of them is a W op. `None` for a dense MLP without tsp.
    fn mlp_gradients_in_b(&self) -> Option<f64> {
        let model = self.model;
        if self.tsp > 1 && model.experts.is_none() {
            return Some(
                self.sharded(3.0 * model.hidden as f64 * model.ffn as f64 / self.tsp as f64 * self.sizes.element, 0.0),
            );
        }
        model.experts.as_ref().map(|_| {
            let routed = self.layer_routed_experts();
            self.sharded(self.router() + routed + self.shared_ring_gradients(), routed) + self.router_kept_whole
        })
    }

    /// Whether the mixture has a Qwen2-MoE shared expert.
    fn shared_expert(&self) -> bool {
        self.model.experts.as_ref().is_some_and(|experts| experts.shared_expert)
    }

    /// Under tsp a shared expert's ring makes its three projections' gradients, tsp's share of
    /// them (bytes, before ZeRO shards them; B's under zero bubble); 0 elsewhere.
    fn shared_ring_gradients(&self) -> f64 {
        if self.shared_expert() && self.tsp > 1 {
            3.0 * self.gate / self.tsp as f64
        } else {
            0.0
        }
    }

    /// Under ZeRO-3 with full recomputation a norm's weight, gathered again to recompute its
    /// output, as the term `name`; `None` otherwise.
    fn norm_regathered(&self, name: &'static str) -> Option<Term> {
        let bytes = self.norms_gathered_again(self.norm * self.sizes.element);
        (self.recompute() == Recompute::Full && bytes > 0.0).then_some(Term { name, bytes })
    }

    /// [`Self::layer_mlp_gradients`], as the rank holds them under ZeRO-2 and 3.
    fn layer_mlp_gradient_shards(&self) -> f64 {
        self.sharded(self.layer_mlp_gradients(), self.layer_routed_experts()) + self.router_kept_whole
    }

    /// Of `router` bytes of a layer's router gradient (the router's, or 0), what the rank holds
    /// once it is reduce-scattered: its shard, and what ZeRO keeps beyond it where its rows split
    /// over fewer replicas.
    fn router_shard(&self, router: f64) -> f64 {
        if router > 0.0 {
            router / self.shards + self.router_kept_whole
        } else {
            0.0
        }
    }

    /// The bytes of a vocabulary table (the embedding, the LM head or a tied table) ZeRO-3
    /// gathers: none where it keeps it whole.
    fn table_gathered_again(&self) -> f64 {
        let StepSizes { element, vocab_shard, hidden, .. } = self.sizes;
        self.gathered_again_where(self.tables_gathered, vocab_shard * hidden * element)
    }

    /// The bytes of a layer's router ZeRO-3 gathers again: none where it keeps it whole.
    fn router_gathered_again(&self) -> f64 {
        self.gathered_again_where(self.router_gathered, self.router())
    }

    /// The bytes of a layer's MLP norm, gate and up weights (a dense MLP's or a shared expert's)
    /// ZeRO-3 gathers again to recompute the MLP's forward: none of those it keeps whole.
    fn mlp_input_weights_gathered_again(&self) -> f64 {
        self.gate_up_gathered_again(2.0 * self.gate) + self.norms_gathered_again(self.norm * self.sizes.element)
    }

    /// The bytes of `projection` (one of a layer's MLP projection's bytes) of each of its gate, up
    /// and down weights that ZeRO-3 gathers again: none of those it keeps whole.
    fn mlp_projections_gathered_again(&self, projection: f64) -> f64 {
        self.gate_up_gathered_again(2.0 * projection) + self.down_gathered_again(projection)
    }

    /// `bytes` of norm weights (a shared expert's gate vector too) ZeRO-3 gathers again: none where
    /// it keeps them whole.
    fn norms_gathered_again(&self, bytes: f64) -> f64 {
        self.gathered_again_where(self.norms_gathered, bytes)
    }

    /// `bytes` of gate and up projection weights ZeRO-3 gathers again: none where it keeps them
    /// whole.
    fn gate_up_gathered_again(&self, bytes: f64) -> f64 {
        self.gathered_again_where(self.gate_up_gathered, bytes)
    }

    /// `bytes` of down projection weights ZeRO-3 gathers again: none where it keeps them whole.
    fn down_gathered_again(&self, bytes: f64) -> f64 {
        self.gathered_again_where(self.down_gathered, bytes)
    }

    /// [`Self::weights_gathered_again`] of weights ZeRO splits (`split`), else none: it keeps them
    /// whole and never gathers them.
    fn gathered_again_where(&self, split: bool, bytes: f64) -> f64 {
        if split {
            self.weights_gathered_again(bytes)
        } else {
            0.0
        }
    }

    /// `bytes` of weights ZeRO-3 (which shards them over their replicas) gathers again for a
    /// backward's recomputation or input gradient; 0 under ZeRO-0 to 2.
    fn weights_gathered_again(&self, bytes: f64) -> f64 {
        if self.scattered && self.workload.zero >= 3 {
            bytes
        } else {
            0.0
        }
    }

    /// Under ZeRO-3 a dense parameter split over more than one of dp, cp and ep is gathered a step
    /// an axis, ep's first and dp's last (`passes::zero`): as the last step runs, the step before's
    /// output is live beside the whole, this share of it (1 over the last axis's degree). 0 where
    /// one step gathers it, or ZeRO-3 none.
    fn two_step_gather_share(&self) -> f64 {
        self.two_step_gather_share_over(&[AxisName::Dp, AxisName::Cp, AxisName::Ep])
    }

    /// The same of a routed expert, which ZeRO splits over dp and cp only (ep splits the experts):
    /// none where their rows split over one of them or neither (gathered in one step or none).
    fn expert_two_step_gather_share(&self) -> f64 {
        if self.expert_shards < self.layout.expert_zero_replicas() as f64 {
            return 0.0;
        }
        self.two_step_gather_share_over(&[AxisName::Dp, AxisName::Cp])
    }

    /// [`Self::two_step_gather_share`] of a parameter whose replicas are `axes`, the last gathered
    /// first.
    fn two_step_gather_share_over(&self, axes: &[AxisName]) -> f64 {
        let mut split = axes.iter().map(|&axis| self.layout.degree(axis)).filter(|&degree| degree > 1);
        match (split.next(), split.next()) {
            (Some(last), Some(_)) => self.weights_gathered_again(1.0) / last as f64,
            _ => 0.0,
        }
    }

    /// Under zero bubble, whether the first stage's B frees a micro-batch's positions: its first
    /// layer's RoPE backward reads them last, but under either recomputation W reads them too (to
    /// recompute attention's output from q, k and v). A micro-batch between its B and W there no
    /// longer holds them; another stage releases them at the micro-batch's end.
    fn positions_freed_in_b(&self) -> bool {
        self.zero_bubble && self.stage == 0 && self.recompute() == Recompute::None
    }

    /// Whether the points of a dense stage's first layer's MLP backward where gate's gradient joins
    /// its sum are modelled: not under ZeRO-2 and 3, which scatter each gradient, or under tsp,
    /// whose ring makes the MLP's gradients. (Under full recomputation the MLP recomputed for it
    /// holds the same buffers there as a kept one, and the attention is not recomputed yet.)
    fn first_layer_mlp_backward_modelled(&self) -> bool {
        self.model.experts.is_none() && !self.scattered && self.tsp == 1
    }

    /// Whether a dense stage's last layer's MLP backward points, at the head of a backward, are
    /// modelled: as [`Self::first_layer_mlp_backward_modelled`], but not under full
    /// recomputation, which recomputes the MLP there beside the head's buffers.
    fn mlp_backward_modelled(&self) -> bool {
        self.first_layer_mlp_backward_modelled() && self.recompute() != Recompute::Full
    }
}

/// A rank's block of one of a layer's attention projections under tsp (its share of the heads,
/// over the axis's owners), which each owner's turn broadcasts.
#[derive(Clone, Copy)]
pub(super) enum TspBlock {
    Q,
    K,
    V,
    O,
}

/// A point of a tsp attention backward, which takes the owners last first, where o's weight
/// gradient is reduced to an owner and a rank may peak (see [`tsp_o_reduces`]).
pub(super) struct TspOReduce {
    /// Whether the owner is this rank (else another, whose reduce leaves zeros here).
    pub to_this_rank: bool,
    /// The name of the rank's contributions to that owner's block of attention weight gradients.
    pub contributions: &'static str,
    /// The reduce's own buffers on this rank.
    pub reduce: Term,
    /// The owners whose backward is still to come.
    pub after: u64,
}

/// Where the rank at `tsp_rank` on a tsp axis of degree `tsp` may peak as o's gradient (an
/// owner's `o_block` bytes) is reduced: to itself (but the axis's last rank, whose owner goes
/// first), its chain what it received and their sum with one peer, the partial sum, the message
/// and the next sum with more, its place on the axis the owners after it; and to another owner,
/// leaving zeros here, the latest such owner having the most after it: the second processed (the
/// third where that one is this rank).
pub(super) fn tsp_o_reduces(tsp: u64, tsp_rank: u64, o_block: f64) -> Vec<TspOReduce> {
    let mut points = Vec::new();
    if tsp_rank + 1 < tsp {
        points.push(tsp_own_o_reduce(tsp, tsp_rank, o_block));
    }
    if let Some(other) = if tsp_rank + 2 == tsp { tsp.checked_sub(3) } else { tsp.checked_sub(2) } {
        points.push(TspOReduce {
            to_this_rank: false,
            contributions: "its contributions to that owner's attention weight gradients",
            reduce: Term { name: "o's reduce to that owner: zeros here", bytes: o_block },
            after: other,
        });
    }
    points
}

/// The point of [`tsp_o_reduces`] where o's gradient is reduced to the rank at `tsp_rank` itself.
fn tsp_own_o_reduce(tsp: u64, tsp_rank: u64, o_block: f64) -> TspOReduce {
    TspOReduce {
        to_this_rank: true,
        contributions: "its contributions to its own attention weight gradients",
        reduce: Term {
            name: "o's reduce: what it received, and the partial sums beside it",
            bytes: if tsp == 2 { 2.0 * o_block } else { 3.0 * o_block },
        },
        after: tsp_rank,
    }
}

/// Where the rank at `tsp_rank` may peak as o's gradient is reduced to the first owner (the
/// axis's last rank, whose backward goes first): to itself on that rank, else to another owner,
/// leaving zeros here; none summed before it, every other owner after it.
pub(super) fn tsp_first_owner_o_reduce(tsp: u64, tsp_rank: u64, o_block: f64) -> TspOReduce {
    if tsp_rank + 1 == tsp {
        tsp_own_o_reduce(tsp, tsp_rank, o_block)
    } else {
        TspOReduce {
            to_this_rank: false,
            contributions: "its contributions to that owner's attention weight gradients",
            reduce: Term { name: "o's reduce to that owner: zeros here", bytes: o_block },
            after: tsp - 1,
        }
    }
}

/// The terms by which [`super::memory`]'s peak of a pipelined stage, `memory`, differs from the
/// compiled stage's `phase` (from [`compiled_stage_peak`]): `memory.peak_bytes` plus these is
/// `phase.bytes()`. Removed: the optimizer state (the executor keeps it beside the program), the
/// closed form's activations of its in-flight micro-batches and its logits or transients, and its
/// one copy of the gradients; added: the phase's buffers, whose running sums and in-flight
/// micro-batches stand for those.
pub fn pipelined_differences_from_closed_form(memory: &MemoryBreakdown, phase: &ForwardPhase) -> Vec<Term> {
    let mut terms = vec![
        Term { name: "optimizer state (kept beside the program)", bytes: -memory.optimizer_bytes },
        Term { name: "closed form's activations of its in-flight micro-batches", bytes: -memory.activations_bytes },
        Term {
            name: "closed form's logits or layer transients",
            bytes: -f64::max(memory.logits_bytes, memory.transient_bytes),
        },
        Term { name: "closed form's gradients (the running sums stand for them)", bytes: -memory.grads_bytes },
        // Zero when the closed form's weights are the program's (the test checks).
        Term { name: "parameters the closed form counts otherwise", bytes: phase.params - memory.params_bytes },
    ];
    terms.extend(phase.terms.iter().cloned());
    terms
}

//! Token inputs: a `--tokens` JSON file (`[[id, ...], ...]`, one row a sequence) or a seeded random batch.

use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::usage::UsageError;

/// Token ids `[batch, seq]`, row-major.
pub struct Tokens {
    pub batch: u64,
    pub seq: u64,
    pub ids: Vec<u32>,
}

impl Tokens {
    /// Refuses tokens other than `batch` sequences of `seq` (what a run is compiled for).
    pub fn expect_shape(&self, batch: u64, seq: u64) -> Result<()> {
        if (self.batch, self.seq) != (batch, seq) {
            bail!(UsageError::TokensShape { batch: self.batch, seq: self.seq, run_batch: batch, run_seq: seq });
        }
        Ok(())
    }

    /// Refuses an id the model's vocabulary of `vocab` entries does not have, before any rank's
    /// embedding meets it.
    pub fn expect_ids_below(&self, vocab: u64) -> Result<()> {
        if let Some(index) = self.ids.iter().position(|&id| u64::from(id) >= vocab) {
            let seq = self.seq.max(1) as usize;
            bail!(UsageError::TokenOutsideVocabulary {
                sequence: index / seq,
                position: index % seq,
                id: self.ids[index],
                vocab,
            });
        }
        Ok(())
    }
}

/// Reads `[batch][seq]` integers from a JSON file.
pub fn read_tokens(path: &Path) -> Result<Tokens> {
    let text = crate::text_file::read_text(path).with_context(|| format!("cannot read {}", path.display()))?;
    let problem = |problem: String| UsageError::TokensFile { path: path.to_path_buf(), problem };
    let rows: Vec<Vec<i64>> = serde_json::from_str(&text).map_err(|error| {
        problem(format!("expected a JSON array of arrays of token ids, [[1, 2, ...], ...] ({error})"))
    })?;
    let Some(first) = rows.first() else { bail!(problem("no sequences".into())) };
    let seq = first.len();
    if seq == 0 {
        bail!(problem("sequence 0 is empty".into()));
    }
    let mut ids = Vec::with_capacity(rows.len() * seq);
    for (row_index, row) in rows.iter().enumerate() {
        if row.len() != seq {
            bail!(problem(format!(
                "sequence {row_index} has {} tokens, sequence 0 has {seq}; all must be equal",
                row.len()
            )));
        }
        for (position, &id) in row.iter().enumerate() {
            let Ok(id) = u32::try_from(id) else {
                bail!(problem(format!("token [{row_index}][{position}] = {id} is not a valid id")));
            };
            ids.push(id);
        }
    }
    Ok(Tokens { batch: rows.len() as u64, seq: seq as u64, ids })
}

/// A deterministic batch of ids below `vocab`, from `seed`; an error when this machine has no room
/// for its ids.
pub fn random_tokens(batch: u64, seq: u64, vocab: u64, seed: u64) -> Result<Tokens> {
    let needed = batch.checked_mul(seq).and_then(|count| count.checked_mul(4)).unwrap_or(u64::MAX);
    crate::host_memory::ensure_available(&format!("a batch of {batch} sequences of {seq} token ids"), needed)?;
    let mut state = seed ^ 0x9e37_79b9_7f4a_7c15;
    let ids = (0..batch * seq)
        .map(|_| {
            // splitmix64: small, stateless and good enough for test inputs.
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) % vocab) as u32
        })
        .collect();
    Ok(Tokens { batch, seq, ids })
}

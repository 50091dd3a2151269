//! The layout of the MPI communicator's messages, as f32 words (MPI moves them as such): a data
//! message is its [`MessageTag`] then the payload; a failure notice is the reason's bytes as words
//! ([`bytes_to_words`], which `pleat rank` uses for the summaries it gathers too).
//!
//! A receiver that reads a header it cannot decode reports a mismatch rather than taking the words
//! as data, so a message that is not pleat's is never mistaken for one.

use super::super::{CollectiveKind, Group, MessageTag};

/// The first header word of every data message, to catch a message that is not pleat's.
const MAGIC: u32 = 0x706c_6174;
/// Header words before the group's ranks: magic, kind, sequence (2), op elements (2), message
/// elements (2), group length.
const FIXED_HEADER_WORDS: usize = 9;
/// Failure notices are cut to this many bytes, so that they go eagerly even to a rank that never
/// receives them.
const MAX_REASON_BYTES: usize = 1024;

fn push_u64(words: &mut Vec<f32>, value: u64) {
    words.push(f32::from_bits(value as u32));
    words.push(f32::from_bits((value >> 32) as u32));
}

fn read_u64(words: &[f32], at: usize) -> u64 {
    u64::from(words[at].to_bits()) | (u64::from(words[at + 1].to_bits()) << 32)
}

/// A data message: the tag's words, then the payload.
pub(super) fn encode_message(tag: &MessageTag, payload: &[f32]) -> Vec<f32> {
    let mut words = Vec::with_capacity(FIXED_HEADER_WORDS + tag.group.len() + payload.len());
    words.push(f32::from_bits(MAGIC));
    let kind = CollectiveKind::ALL.iter().position(|&kind| kind == tag.kind).unwrap_or(0);
    words.push(f32::from_bits(kind as u32));
    push_u64(&mut words, tag.sequence);
    push_u64(&mut words, tag.op_elements as u64);
    push_u64(&mut words, tag.message_elements as u64);
    words.push(f32::from_bits(tag.group.len() as u32));
    words.extend(tag.group.ranks.iter().map(|&rank| f32::from_bits(rank)));
    words.extend_from_slice(payload);
    words
}

/// The tag and the offset of the payload of a data message; `None` if it is not one of pleat's.
pub(super) fn decode_header(words: &[f32]) -> Option<(MessageTag, usize)> {
    if words.len() < FIXED_HEADER_WORDS || words[0].to_bits() != MAGIC {
        return None;
    }
    let kind = *CollectiveKind::ALL.get(words[1].to_bits() as usize)?;
    let group_len = words[8].to_bits() as usize;
    let payload_start = FIXED_HEADER_WORDS.checked_add(group_len)?;
    let ranks = words.get(FIXED_HEADER_WORDS..payload_start)?.iter().map(|word| word.to_bits()).collect::<Vec<_>>();
    let tag = MessageTag {
        kind,
        group: Group::new(ranks),
        sequence: read_u64(words, 2),
        op_elements: read_u64(words, 4) as usize,
        message_elements: read_u64(words, 6) as usize,
    };
    Some((tag, payload_start))
}

/// A failure notice: the byte length of `reason` (cut to [`MAX_REASON_BYTES`] at a character
/// boundary), then its bytes, four a word.
pub(super) fn encode_notice(reason: &str) -> Vec<f32> {
    let mut cut = reason.len().min(MAX_REASON_BYTES);
    while !reason.is_char_boundary(cut) {
        cut -= 1;
    }
    bytes_to_words(&reason.as_bytes()[..cut])
}

/// The reason a failure notice carries.
pub(super) fn decode_notice(words: &[f32]) -> String {
    String::from_utf8_lossy(&words_to_bytes(words)).into_owned()
}

/// Bytes as f32 words, as the communicators carry them: the byte count, then the bytes four a
/// word (the last zero-padded).
pub fn bytes_to_words(bytes: &[u8]) -> Vec<f32> {
    let mut words = vec![f32::from_bits(bytes.len() as u32)];
    words.extend(bytes.chunks(4).map(|chunk| {
        let mut word = [0u8; 4];
        word[..chunk.len()].copy_from_slice(chunk);
        f32::from_bits(u32::from_le_bytes(word))
    }));
    words
}

/// The inverse of [`bytes_to_words`]; a count past the words gives the bytes they hold.
pub fn words_to_bytes(words: &[f32]) -> Vec<u8> {
    let len = words.first().map_or(0, |word| word.to_bits() as usize);
    let mut bytes: Vec<u8> = words.iter().skip(1).flat_map(|word| word.to_bits().to_le_bytes()).collect();
    bytes.truncate(len);
    bytes
}

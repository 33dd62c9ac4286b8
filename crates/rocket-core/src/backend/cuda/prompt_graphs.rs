//! CUDA graphs of short prompt passes (`GpuOptions::prompt_graphs`).
//!
//! A prompt pass launches ~10 kernels a layer one by one, ~5 µs of host time
//! each, so at 128 rows the small fuels' passes wait on the host, not the GPU.
//! A graph replays a whole pass in one launch, but only a pass of the same
//! shape: so a pass of up to `PROMPT_GRAPH_MAX_ROWS` rows is padded to its row
//! bucket (`bucket_rows`), and every prompt length of a bucket shares a graph
//! (one per pass shape: the bucket, the prompts in the pass, what it picks).
//! The pad rows are a sequence of their own, with their own KV positions
//! (`PAD_POSITIONS`), so the prompt's rows never read them. They repeat a
//! prompt's first tokens from position 0 (`pad_source`): where a prompt starts
//! its session and is at least as long as the pad, they compute what its first
//! rows compute, so they reach no value the pass does not (the fp16 range test
//! looks at every row); otherwise they are ordinary tokens at the first
//! positions, which a real prompt's first rows also are.

use std::collections::HashMap;
use std::hash::Hash;

/// The longest pass padded and replayed from a graph. Longer passes take the
/// GPU long enough (a 512-row Llama-3.2-1B pass: ~3 ms on an H100) that their
/// launches hide behind the kernels, and their row counts (up to 2,559) would
/// need many more buckets.
pub(crate) const PROMPT_GRAPH_MAX_ROWS: usize = 512;

/// Buckets from 32 rows on are multiples of this: a pad of at most 31 rows
/// costs a bandwidth-bound pass little, and 16 buckets cover 33..=512.
const BUCKET_STEP: usize = 32;

/// The most pad rows a pass gets (`bucket_rows(rows) - rows` is at most this):
/// the KV positions the pad sequence needs.
pub(crate) const PAD_POSITIONS: usize = BUCKET_STEP - 1;

/// Graphs kept at most; the least recently replayed goes first. One prompt a
/// pass, greedy or sampled, takes up to 21 (the buckets); later passes (after a
/// reused prefix) add one per bucket and context split count, and passes of
/// several prompts one per prompt count.
const GRAPHS_KEPT: usize = 32;

/// Shapes seen once are remembered up to this many (then forgotten together).
const SHAPES_SEEN: usize = 256;

/// The rows a pass of `rows` rows runs padded to: the next power of two below
/// `BUCKET_STEP` (2, 4, 8, 16, 32), else the next multiple of `BUCKET_STEP`.
pub(crate) fn bucket_rows(rows: usize) -> usize {
    if rows <= BUCKET_STEP {
        rows.next_power_of_two()
    } else {
        rows.next_multiple_of(BUCKET_STEP)
    }
}

/// The padded row count of a pass of prompt chunks of these lengths, or None
/// where the pass is not replayed from a prompt graph: a chunk of one token (a
/// decode row, on the split attention) or more rows than `PROMPT_GRAPH_MAX_ROWS`.
pub(crate) fn padded_rows(chunk_lens: impl IntoIterator<Item = usize>) -> Option<usize> {
    let mut rows = 0;
    for len in chunk_lens {
        if len < 2 {
            return None;
        }
        rows += len;
    }
    (rows > 0 && rows <= PROMPT_GRAPH_MAX_ROWS).then(|| bucket_rows(rows))
}

/// Which chunk's tokens the pad rows repeat, given each chunk's (length, first
/// position): the longest that starts its session and holds the whole pad
/// (its first rows are then computed twice, alike), else the first chunk.
pub(crate) fn pad_source(chunks: impl IntoIterator<Item = (usize, usize)>, pad: usize) -> usize {
    chunks
        .into_iter()
        .enumerate()
        .filter(|(_, (len, start))| *start == 0 && *len >= pad)
        .max_by_key(|(i, (len, _))| (*len, std::cmp::Reverse(*i)))
        .map_or(0, |(i, _)| i)
}

/// The token of pad row `i`: the source chunk's tokens from its start, repeated.
pub(crate) fn pad_token(source: &[u32], i: usize) -> u32 {
    source[i % source.len()]
}

/// Graphs by the shape they recorded, at most `GRAPHS_KEPT`, the least recently
/// used evicted first. A shape is recorded the second time it is seen: a pass
/// shape that comes once (a batch of prompts of a rare mix) launches kernel by
/// kernel rather than pay a recording it never replays. Generic over the graph
/// so its bookkeeping is tested without a GPU.
pub(crate) struct GraphCache<K, G> {
    entries: HashMap<K, (G, u64)>,
    seen: std::collections::HashSet<K>,
    clock: u64,
}

impl<K: Hash + Eq + Clone, G> GraphCache<K, G> {
    pub(crate) fn new() -> Self {
        GraphCache { entries: HashMap::new(), seen: Default::default(), clock: 0 }
    }

    pub(crate) fn contains(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    /// Whether a pass of shape `key` runs from a graph: one kept, or one to
    /// record now (from the second time it is asked for the same shape).
    pub(crate) fn replays(&mut self, key: &K) -> bool {
        if self.entries.contains_key(key) || self.seen.contains(key) {
            return true;
        }
        if self.seen.len() >= SHAPES_SEEN {
            self.seen.clear();
        }
        self.seen.insert(key.clone());
        false
    }

    /// Keeps `graph` for `key`, first dropping the least recently used graph
    /// where the cache is full.
    pub(crate) fn insert(&mut self, key: K, graph: G) {
        if !self.entries.contains_key(&key) && self.entries.len() >= GRAPHS_KEPT {
            let oldest = self.entries.iter().min_by_key(|(_, (_, used))| *used).map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                self.entries.remove(&k);
            }
        }
        self.clock += 1;
        self.entries.insert(key, (graph, self.clock));
    }

    /// The graph for `key`, marked as just used.
    pub(crate) fn get(&mut self, key: &K) -> Option<&G> {
        self.clock += 1;
        let clock = self.clock;
        self.entries.get_mut(key).map(|(graph, used)| {
            *used = clock;
            &*graph
        })
    }

    /// Drops every graph (their buffers moved, or the products changed kernels);
    /// the shapes seen stay seen, so they record again at their next pass.
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::kernels::PREFILL_TILE;

    #[test]
    fn buckets_cover_every_row_count_with_a_pad_that_fits_one_tile() {
        let mut buckets = std::collections::BTreeSet::new();
        for rows in 1..=PROMPT_GRAPH_MAX_ROWS {
            let b = bucket_rows(rows);
            assert!(b >= rows && b <= PROMPT_GRAPH_MAX_ROWS, "{rows} rows -> {b}");
            let pad = b - rows;
            assert!(pad <= PAD_POSITIONS && pad < PREFILL_TILE, "{rows} rows pad {pad}");
            // A pad shorter than the prompt: on a first pass it repeats real rows.
            assert!(pad < rows, "{rows} rows pad {pad}");
            // Every bucket is its own bucket (padding twice changes nothing).
            assert_eq!(bucket_rows(b), b);
            buckets.insert(b);
        }
        let expected: Vec<usize> = [1, 2, 4, 8, 16].into_iter().chain((1..=16).map(|k| 32 * k)).collect();
        assert_eq!(buckets.into_iter().collect::<Vec<_>>(), expected);
    }

    #[test]
    fn only_prompt_chunks_up_to_the_limit_are_padded() {
        assert_eq!(padded_rows([100]), Some(128));
        assert_eq!(padded_rows([30, 50]), Some(96));
        assert_eq!(padded_rows([2]), Some(2));
        assert_eq!(padded_rows([3]), Some(4));
        assert_eq!(padded_rows([512]), Some(512));
        assert_eq!(padded_rows([500, 12]), Some(512));
        assert_eq!(padded_rows([513]), None);
        assert_eq!(padded_rows([500, 13]), None);
        // A decode row beside a prompt: the split attention's rows are not padded.
        assert_eq!(padded_rows([100, 1]), None);
        assert_eq!(padded_rows([1]), None);
        assert_eq!(padded_rows(std::iter::empty()), None);
    }

    #[test]
    fn pad_tokens_repeat_a_prompt_that_starts_its_session_and_holds_the_pad() {
        let first = [7u32, 8, 9];
        let got: Vec<u32> = (0..7).map(|i| pad_token(&first, i)).collect();
        assert_eq!(got, [7, 8, 9, 7, 8, 9, 7]);
        // (length, first position) per chunk.
        assert_eq!(pad_source([(100, 0)], 28), 0);
        assert_eq!(pad_source([(2, 0), (31, 0)], 31), 1, "the first chunk is shorter than the pad");
        assert_eq!(pad_source([(40, 300), (33, 0), (60, 0), (60, 0)], 20), 2, "the longest that starts its session, the first of equals");
        assert_eq!(pad_source([(100, 500), (40, 0)], 30), 1, "a longer prompt that continues its session is not repeated");
        assert_eq!(pad_source([(200, 2360)], 24), 0, "a later pass alone: its own tokens");
        assert_eq!(pad_source([(5, 0), (6, 0)], 20), 0, "none holds the pad");
    }

    #[test]
    fn the_cache_keeps_the_most_recently_used_graphs() {
        let mut cache: GraphCache<usize, String> = GraphCache::new();
        for k in 0..GRAPHS_KEPT {
            cache.insert(k, format!("g{k}"));
        }
        assert_eq!(cache.len(), GRAPHS_KEPT);
        // Key 0 used again: key 1 is now the least recently used.
        assert_eq!(cache.get(&0).map(String::as_str), Some("g0"));
        cache.insert(GRAPHS_KEPT, "new".into());
        assert_eq!(cache.len(), GRAPHS_KEPT);
        assert!(cache.contains(&0) && !cache.contains(&1) && cache.contains(&GRAPHS_KEPT));
        // Replacing a kept key evicts nothing.
        cache.insert(0, "g0'".into());
        assert_eq!(cache.len(), GRAPHS_KEPT);
        assert!(cache.contains(&2));
        assert_eq!(cache.get(&0).map(String::as_str), Some("g0'"));
        assert!(cache.get(&1).is_none());
        cache.clear();
        assert_eq!(cache.len(), 0);
    }

    #[test]
    fn a_shape_records_from_its_second_pass() {
        let mut cache: GraphCache<usize, ()> = GraphCache::new();
        assert!(!cache.replays(&5));
        assert!(cache.replays(&5));
        assert!(!cache.replays(&6));
        cache.insert(5, ());
        cache.clear();
        assert!(cache.replays(&5), "still seen after the graphs were dropped");
        // A kept graph replays, seen or not.
        cache.insert(7, ());
        assert!(cache.replays(&7));
        // Past the bound, the shapes seen are forgotten together.
        for k in 100..100 + SHAPES_SEEN {
            cache.replays(&k);
        }
        assert!(!cache.replays(&6));
    }
}

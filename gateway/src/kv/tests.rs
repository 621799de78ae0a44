use super::*;

/// What the scheduler does with one sequence, condensed: reuse the cached prefix, allocate the
/// rest, write `prompt + generated` (all but the last sampled token reach the cache), publish
/// every full page, release. Returns the cached (reused) prompt tokens, or None when memory
/// does not suffice.
fn run(kv: &mut KvCache, prompt: &[u32], generated: &[u32]) -> Option<usize> {
    let ps = kv.page_size();
    let hits = kv.acquire_prefix(prompt, true);
    let mut written: Vec<u32> = prompt.to_vec();
    written.extend_from_slice(generated);
    if !generated.is_empty() {
        written.pop(); // the last sampled token is never fed back
    }
    let need = written.len().div_ceil(ps);
    let mut pages: Vec<PageId> = hits.iter().map(|h| h.page).collect();
    match kv.alloc(need - pages.len()) {
        Some(p) => pages.extend(p),
        None => {
            kv.release(&pages, true);
            return None;
        }
    }
    let mut parent = ROOT;
    for (i, chunk) in written.chunks_exact(ps).enumerate() {
        parent = kv.publish(pages[i], parent, chunk);
    }
    kv.release(&pages, true);
    kv.check_invariants();
    Some(hits.len() * ps)
}

fn seq(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

#[test]
fn chain_hash_depends_on_parent_and_order() {
    assert_ne!(chain_hash(ROOT, &[1, 2]), chain_hash(ROOT, &[2, 1]));
    assert_ne!(chain_hash(ROOT, &[1, 2]), chain_hash(1, &[1, 2]));
    assert_eq!(chain_hash(ROOT, &[1, 2]), chain_hash(ROOT, &[1, 2]));
}

#[test]
fn scripted_reuse_counts() {
    let mut kv = KvCache::new(4, 16);
    let a = seq(1..11); // 10 tokens: pages [1..5) [5..9) and a partial one
    assert_eq!(run(&mut kv, &a, &[]), Some(0));
    assert_eq!(kv.cached_pages(), 2);
    assert_eq!(kv.free_pages(), 14);

    // Shared prefix of two full pages, then new tokens.
    let mut b = a[..8].to_vec();
    b.extend([20, 21, 22]);
    assert_eq!(run(&mut kv, &b, &[]), Some(8));

    // Divergence in the middle of the second page: only the first page is reused.
    let mut c = a[..6].to_vec();
    c.extend([30, 31, 32, 33, 34]);
    assert_eq!(run(&mut kv, &c, &[]), Some(4));

    // Exact repeat: every full page before the last token.
    assert_eq!(run(&mut kv, &a, &[]), Some(8));

    // Page-aligned exact repeat: the last page is recomputed so a token is left to feed.
    assert_eq!(run(&mut kv, &a[..8], &[]), Some(4));

    // A follow-up turn reuses the previous turn's prompt AND generated pages.
    let turn1 = seq(100..106); // 6 tokens
    let gen1 = [200, 201, 202, 203]; // writes 6 + 3 = 9 tokens: 2 full pages
    assert_eq!(run(&mut kv, &turn1, &gen1), Some(0));
    let mut turn2 = turn1.clone();
    turn2.extend(gen1);
    turn2.extend([300, 301, 302]);
    assert_eq!(run(&mut kv, &turn2, &[]), Some(8));

    // Unrelated prompt: nothing reused, nothing lost.
    assert_eq!(run(&mut kv, &seq(500..509), &[]), Some(0));
    assert_eq!(run(&mut kv, &a, &[]), Some(8));
    assert_eq!(kv.stats().evictions, 0);
}

#[test]
fn eviction_only_under_pressure_and_lru_order() {
    // 6 pages of 4 tokens.
    let mut kv = KvCache::new(4, 6);
    let x = seq(1..9); // 2 full pages
    let y = seq(50..58); // 2 full pages
    assert_eq!(run(&mut kv, &x, &[]), Some(0));
    assert_eq!(run(&mut kv, &y, &[]), Some(0));
    // Memory allows both: no evictions, both still reusable.
    assert_eq!(kv.stats().evictions, 0);
    assert_eq!(kv.free_pages(), 2);
    assert_eq!(kv.evictable_pages(), 4);
    // Use x again (x becomes most recently used; reuses 1 page, writes its 2nd again into a
    // private page that is freed).
    assert_eq!(run(&mut kv, &x, &[]), Some(4));
    // A 12-token prompt needs 3 pages: 2 free + 1 evicted, the least recently used one:
    // x's tail page (the re-run above touched only x's first page).
    let z = seq(80..92);
    assert_eq!(run(&mut kv, &z, &[]), Some(0));
    assert_eq!(kv.stats().evictions, 1);
    assert_eq!(kv.lookup(&x, 2).len(), 1);
    assert_eq!(kv.lookup(&y, 2).len(), 2);
    assert_eq!(kv.lookup(&z, 3).len(), 3);
    // A prompt needing every page evicts everything unreferenced.
    assert_eq!(run(&mut kv, &seq(1000..1024), &[]), Some(0));
    assert_eq!(run(&mut kv, &[1, 2, 3, 4, 5, 6, 7, 8, 9], &[]), Some(0));
    // Larger than memory: refused, nothing leaked.
    assert_eq!(run(&mut kv, &seq(0..40), &[]), None);
    kv.check_invariants();
    assert_eq!(kv.used_pages(), 0);
}

#[test]
fn referenced_pages_are_never_evicted() {
    let mut kv = KvCache::new(4, 4);
    let x = seq(1..9);
    assert_eq!(run(&mut kv, &x, &[]), Some(0));
    // A running sequence holds x's first page.
    let hits = kv.acquire_prefix(&[1, 2, 3, 4, 5, 6, 7, 8, 9], true);
    assert_eq!(hits.len(), 2);
    assert_eq!(kv.available(), 2);
    assert!(kv.alloc(3).is_none());
    let p = kv.alloc(2).unwrap();
    kv.check_invariants();
    kv.release(&p, true);
    kv.release(&hits.iter().map(|h| h.page).collect::<Vec<_>>(), true);
    kv.check_invariants();
    assert_eq!(kv.lookup(&x, 8).len(), 2);
}

#[test]
fn duplicate_publish_keeps_one_copy() {
    let mut kv = KvCache::new(2, 8);
    let a = kv.alloc(1).unwrap();
    let b = kv.alloc(1).unwrap();
    let ka = kv.publish(a[0], ROOT, &[7, 8]);
    let kb = kv.publish(b[0], ROOT, &[7, 8]);
    assert_eq!(ka, kb);
    kv.release(&a, true);
    kv.release(&b, true);
    kv.check_invariants();
    assert_eq!(kv.cached_pages(), 1);
    assert_eq!(kv.free_pages(), 7);
}

#[test]
fn untouched_use_keeps_lru_position() {
    // Scoring borrows cached pages without making them most recently used.
    let mut kv = KvCache::new(2, 4);
    assert_eq!(run(&mut kv, &[1, 2, 9], &[]), Some(0)); // page [1,2] cached (older)
    assert_eq!(run(&mut kv, &[3, 4, 9], &[]), Some(0)); // page [3,4] cached (newer)
    let hits = kv.acquire_prefix(&[1, 2, 9], false);
    assert_eq!(hits.len(), 1);
    kv.release(&[hits[0].page], false);
    kv.check_invariants();
    // Two pages needed beyond the free ones: the first eviction takes [1,2], still the oldest.
    let p = kv.alloc(3).unwrap();
    assert_eq!(kv.stats().evictions, 1);
    assert!(kv.lookup(&[1, 2], 1).is_empty());
    assert_eq!(kv.lookup(&[3, 4], 1).len(), 1);
    kv.release(&p, true);
}

#[test]
fn clear_drops_everything() {
    let mut kv = KvCache::new(4, 8);
    run(&mut kv, &seq(1..20), &[]);
    kv.clear();
    kv.check_invariants();
    assert_eq!(kv.cached_pages(), 0);
    assert_eq!(kv.free_pages(), 8);
}

//! Streaming tag search: how much of a buffer is safe to release when a tag may be arriving
//! split across chunks.

/// Length of the longest suffix of `buf` that is a proper prefix of `tag`: those bytes must be
/// held back because the next chunk may complete the tag.
pub fn partial_tag_len(buf: &str, tag: &str) -> usize {
    let max = buf.len().min(tag.len().saturating_sub(1));
    (1..=max)
        .rev()
        .find(|&k| {
            tag.is_char_boundary(k)
                && buf.is_char_boundary(buf.len() - k)
                && buf.ends_with(&tag[..k])
        })
        .unwrap_or(0)
}

/// Whether `buf` could still grow into something starting with `tag` (it is a prefix of it).
pub fn could_become(buf: &str, tag: &str) -> bool {
    buf.len() < tag.len() && tag.starts_with(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_partial_prefixes() {
        assert_eq!(partial_tag_len("abc</th", "</think>"), 4);
        assert_eq!(partial_tag_len("abc<", "</think>"), 1);
        assert_eq!(partial_tag_len("abc", "</think>"), 0);
        // A complete tag is not "partial": the caller finds it with `find`.
        assert_eq!(partial_tag_len("</think>", "</think>"), 0);
        assert_eq!(partial_tag_len("é<", "<é>"), 1);
        assert!(could_become("<inv", "<invoke name=\""));
        assert!(!could_become("<x", "<invoke"));
    }
}

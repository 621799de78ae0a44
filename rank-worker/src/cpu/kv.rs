//! The paged KV cache of the CPU backend: for each local layer, K and V for `n_pages` pages
//! of `page_size` token slots, each slot holding this rank's KV heads.

/// K/V storage for this rank's layers and KV heads, in f32.
pub struct PagedKv {
    pub page_size: usize,
    pub n_pages: usize,
    kv_heads: usize,
    k_dim: usize,
    v_dim: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl PagedKv {
    /// Allocates a zeroed cache for `n_layers` local layers.
    pub fn new(n_layers: usize, page_size: usize, n_pages: usize, kv_heads: usize, k_dim: usize, v_dim: usize) -> Self {
        let slots = page_size * n_pages;
        Self {
            page_size,
            n_pages,
            kv_heads,
            k_dim,
            v_dim,
            k: (0..n_layers).map(|_| vec![0.0; slots * kv_heads * k_dim]).collect(),
            v: (0..n_layers).map(|_| vec![0.0; slots * kv_heads * v_dim]).collect(),
        }
    }

    /// Physical slot of position `pos` of a sequence with `page_table`.
    #[inline]
    pub fn slot(&self, page_table: &[u32], pos: usize) -> usize {
        page_table[pos / self.page_size] as usize * self.page_size + pos % self.page_size
    }

    /// Stores the K and V of one token (all local KV heads, concatenated) at `slot`.
    pub fn write(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let (kw, vw) = (self.kv_heads * self.k_dim, self.kv_heads * self.v_dim);
        self.k[layer][slot * kw..(slot + 1) * kw].copy_from_slice(k);
        self.v[layer][slot * vw..(slot + 1) * vw].copy_from_slice(v);
    }

    /// K of local KV head `h` at `slot`.
    #[inline]
    pub fn k(&self, layer: usize, slot: usize, h: usize) -> &[f32] {
        let o = (slot * self.kv_heads + h) * self.k_dim;
        &self.k[layer][o..o + self.k_dim]
    }

    /// V of local KV head `h` at `slot`.
    #[inline]
    pub fn v(&self, layer: usize, slot: usize, h: usize) -> &[f32] {
        let o = (slot * self.kv_heads + h) * self.v_dim;
        &self.v[layer][o..o + self.v_dim]
    }
}

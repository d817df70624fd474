//! The HF models as engine ops: each function names the transformers function it mirrors.
//! [`transformer`] builds the parameters and runs the decoder stack, [`attention`] its
//! attention kernels and masks, [`mla`] DeepSeek's latent attention, [`moe`] routed experts ([`moe_ep`] under expert parallelism), [`heads`] the output heads and losses, [`liger`]
//! liger-kernel's replacements for some of them, [`load`]
//! `from_pretrained`, [`quant`] the bitsandbytes 4-bit weights and peft's k-bit preparation, [`trl`] TRL's fused LM head
//! and its trainers' losses; [`release`] what an older transformers release's code does differently.

pub(crate) mod attention;
pub(crate) mod heads;
pub(crate) mod liger;
pub(crate) mod load;
pub(crate) mod megatron;
pub(crate) mod megatron_mlp;
pub(crate) mod megatron_moe;
pub(crate) mod megatron_sp;
pub(crate) mod mla;
pub(crate) mod moe;
pub(crate) mod moe_ep;
pub(crate) mod quant;
pub(crate) mod release;
pub(crate) mod transformer;
pub(crate) mod trl;

/// What the training step needs to know about the shapes of one forward: `b` sequences of
/// `s` tokens.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Batch {
    pub b: u64,
    pub s: u64,
}

impl Batch {
    /// Rows of the flattened activations.
    pub fn n(&self) -> u64 {
        self.b * self.s
    }
}

/// Which attention kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AttentionImpl {
    Sdpa,
    Eager,
}

//! Element types of the tensors a step allocates.

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
    I64,
    I32,
    U8,
    Bool,
}

impl DType {
    pub const fn bytes(self) -> u64 {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::I64 => 8,
            DType::U8 | DType::Bool => 1,
        }
    }

    pub const fn is_half(self) -> bool {
        matches!(self, DType::BF16 | DType::F16)
    }

    /// The type kernels accumulate in (`at::opmath_type`): fp32 for half types.
    pub const fn opmath(self) -> DType {
        if self.is_half() { DType::F32 } else { self }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "fp32",
            DType::BF16 => "bf16",
            DType::F16 => "fp16",
            DType::I64 => "int64",
            DType::I32 => "int32",
            DType::U8 => "uint8",
            DType::Bool => "bool",
        })
    }
}

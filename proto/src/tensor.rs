//! Tensor frames: a dense tensor as shape + little-endian bytes.

use serde::{Deserialize, Serialize};

/// Element type of a [`TensorFrame`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 32-bit unsigned integer.
    U32,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        4
    }
}

/// A dense row-major tensor on the wire.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorFrame {
    /// Element type.
    pub dtype: DType,
    /// Dimensions, outermost first.
    pub shape: Vec<u32>,
    /// Little-endian element bytes, `product(shape) * dtype.size()` long.
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
}

impl TensorFrame {
    /// Builds an f32 frame.
    pub fn from_f32(shape: &[usize], values: &[f32]) -> Self {
        Self::build(DType::F32, shape, values.iter().map(|v| v.to_le_bytes()))
    }

    /// Builds a u32 frame.
    pub fn from_u32(shape: &[usize], values: &[u32]) -> Self {
        Self::build(DType::U32, shape, values.iter().map(|v| v.to_le_bytes()))
    }

    fn build(dtype: DType, shape: &[usize], elems: impl ExactSizeIterator<Item = [u8; 4]>) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            elems.len(),
            "shape mismatch"
        );
        let mut data = Vec::with_capacity(elems.len() * 4);
        elems.for_each(|e| data.extend_from_slice(&e));
        Self {
            dtype,
            shape: shape.iter().map(|&d| d as u32).collect(),
            data,
        }
    }

    /// The shape as `usize`s.
    pub fn dims(&self) -> Vec<usize> {
        self.shape.iter().map(|&d| d as usize).collect()
    }

    /// Checks that the byte length matches shape and dtype.
    pub fn validate(&self) -> Result<(), String> {
        let n = self
            .shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d as usize))
            .ok_or("tensor shape overflows")?;
        if n.checked_mul(self.dtype.size()) != Some(self.data.len()) {
            return Err(format!(
                "tensor of shape {:?} needs {} bytes, frame has {}",
                self.shape,
                n.saturating_mul(self.dtype.size()),
                self.data.len()
            ));
        }
        Ok(())
    }

    /// Decodes an f32 frame.
    pub fn to_f32(&self) -> Result<Vec<f32>, String> {
        Ok(self.words(DType::F32)?.map(f32::from_le_bytes).collect())
    }

    /// Decodes a u32 frame.
    pub fn to_u32(&self) -> Result<Vec<u32>, String> {
        Ok(self.words(DType::U32)?.map(u32::from_le_bytes).collect())
    }

    /// The 4-byte little-endian elements of a valid frame of type `want`.
    fn words(&self, want: DType) -> Result<impl Iterator<Item = [u8; 4]> + '_, String> {
        if self.dtype != want {
            return Err(format!("expected {want:?} tensor, got {:?}", self.dtype));
        }
        self.validate()?;
        Ok(self.data.chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_validation() {
        let t = TensorFrame::from_f32(&[2, 2], &[1.0, -2.5, 3.0, 0.0]);
        let back: TensorFrame = crate::cbor::from_slice(&crate::cbor::to_vec(&t)).unwrap();
        assert_eq!(back.to_f32().unwrap(), vec![1.0, -2.5, 3.0, 0.0]);
        assert!(back.to_u32().is_err());
        let mut bad = back.clone();
        bad.data.pop();
        assert!(bad.validate().is_err());
        bad.shape = vec![u32::MAX, u32::MAX, u32::MAX];
        assert!(bad.validate().is_err());
        // Elements fit a usize, bytes do not: an error, not an overflow
        // (which panics where overflow checks are on, as in fuzz builds).
        bad.shape = vec![u32::MAX, u32::MAX];
        // (The unchecked product wrapped in release builds: another number.)
        let err = bad.validate().unwrap_err();
        assert!(
            err.contains(&format!("needs {} bytes", usize::MAX)),
            "{err}"
        );
    }
}

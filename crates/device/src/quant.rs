//! A frozen base held quantized on the device (QLoRA): NF4 codes with their block maxima (fp32,
//! or double-quantized as the CPU holds them) and int8 rows with their scales, uploaded as they
//! are, and [`Gpu::dequantize`], the twin of `tensor::quant`'s `Nf4::dequantize_into` and
//! `Int8Rows::dequantize_rows`, expanding one into fp32 where a product reads it.

use crate::kernels::u;
use crate::shader::{kernel, Kernel};
use crate::{At, Buf, DType, DeviceError, Gpu};
use tensor::quant::{Absmax, Int8Rows, Nf4, QPart};

const DEQUANTIZE: Kernel = kernel!("dequantize", ["OUT", "Q", "AM", "SC"], writes ["OUT"]);
/// This module's kernels (the CUDA build compiles each).
pub(crate) const KERNELS: &[&Kernel] = &[&DEQUANTIZE];

/// One quantized tensor on the device.
pub struct QBuf {
    pub len: usize,
    mode: u32,
    /// Int8: the row length.
    cols: usize,
    mean: f32,
    codes: Buf,
    absmax: Option<Buf>,
    scales: Option<Buf>,
}

impl QBuf {
    /// Device bytes held.
    pub fn bytes(&self) -> u64 {
        [Some(&self.codes), self.absmax.as_ref(), self.scales.as_ref()].into_iter().flatten().map(|b| 4 * b.len() as u64).sum()
    }
}

/// `bytes` four to a little-endian word.
fn words(bytes: &[u8]) -> Vec<u32> {
    bytes.chunks(4).map(|c| c.iter().rev().fold(0u32, |w, &b| (w << 8) | b as u32)).collect()
}

impl Gpu {
    fn upload_words(&self, data: &[u32]) -> Result<Buf, DeviceError> {
        let b = self.alloc(data.len().max(1), DType::U32)?;
        self.write_words(&b, 0, data);
        Ok(b)
    }

    fn upload_f32(&self, data: &[f32]) -> Result<Buf, DeviceError> {
        let b = self.alloc(data.len().max(1), DType::F32)?;
        self.write(&b, data);
        Ok(b)
    }

    /// A quantized tensor uploaded as it is held (codes, maxima, scales); nothing dequantized.
    pub fn upload_quantized(&self, q: QPart) -> Result<QBuf, DeviceError> {
        Ok(match q {
            QPart::Nf4(Nf4 { len, codes, absmax }) => {
                let codes = self.upload_words(&words(codes))?;
                match absmax {
                    Absmax::F32(m) => QBuf { len: *len, mode: 0, cols: 0, mean: 0.0, codes, absmax: Some(self.upload_f32(m)?), scales: None },
                    Absmax::Double { codes: c, scales, mean } => {
                        QBuf { len: *len, mode: 1, cols: 0, mean: *mean, codes, absmax: Some(self.upload_words(&words(c))?), scales: Some(self.upload_f32(scales)?) }
                    }
                }
            }
            QPart::Int8(Int8Rows { rows, cols, codes, scales }) => {
                let bytes: Vec<u8> = codes.iter().map(|&c| c as u8).collect();
                QBuf { len: rows * cols, mode: 2, cols: *cols, mean: 0.0, codes: self.upload_words(&words(&bytes))?, absmax: None, scales: Some(self.upload_f32(scales)?) }
            }
        })
    }

    /// `out[.. q.len]` = `q` in fp32 (`out` an fp32 view).
    pub fn dequantize(&self, out: At, q: &QBuf) {
        assert!(out.buf.dtype() == DType::F32 && out.fits(q.len), "dequantize: the output must be fp32 and hold {} elements", q.len);
        let args = [u(q.len), u(out.off), q.mode, u(q.cols.max(1)), q.mean.to_bits()];
        self.launch(&DEQUANTIZE, Gpu::grid(q.len, 256), &args, &[Some(out.buf), Some(&q.codes), q.absmax.as_ref(), q.scales.as_ref()]);
    }
}

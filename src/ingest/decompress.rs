//! Request body decompression with a limit on the output, so that a small compressed bomb is
//! refused after at most `limit + 1` bytes of work.

use std::io::Read;

use super::IngestError;

/// A request body's `Content-Encoding`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentEncoding {
    /// No compression.
    Identity,
    /// gzip (RFC 1952); several concatenated members are read as one stream.
    Gzip,
    /// Zstandard (RFC 8878).
    Zstd,
}

impl ContentEncoding {
    /// Parses a `Content-Encoding` header value (absent or empty means identity).
    pub(crate) fn from_header(value: Option<&str>) -> Result<Self, IngestError> {
        let Some(value) = value else {
            return Ok(ContentEncoding::Identity);
        };
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "identity" => Ok(ContentEncoding::Identity),
            "gzip" | "x-gzip" => Ok(ContentEncoding::Gzip),
            "zstd" => Ok(ContentEncoding::Zstd),
            _ => Err(IngestError::UnsupportedEncoding(value.to_owned())),
        }
    }

    fn name(self) -> &'static str {
        match self {
            ContentEncoding::Identity => "identity",
            ContentEncoding::Gzip => "gzip",
            ContentEncoding::Zstd => "zstd",
        }
    }
}

/// Decompresses `body` into a new buffer of at most `limit` bytes.
///
/// An identity body is copied only when it is within the limit. Output past the limit stops
/// the decompressor and answers [`IngestError::BodyTooLarge`].
///
/// ```
/// use sluice::ingest::{decompress, ContentEncoding, IngestError};
/// let packed = zstd::encode_all(&[b'x'; 1000][..], 3).unwrap();
/// assert_eq!(decompress(&packed, ContentEncoding::Zstd, 1000).unwrap().len(), 1000);
/// assert!(matches!(
///     decompress(&packed, ContentEncoding::Zstd, 999),
///     Err(IngestError::BodyTooLarge { limit: 999 })
/// ));
/// ```
pub fn decompress(
    body: &[u8],
    encoding: ContentEncoding,
    limit: usize,
) -> Result<Vec<u8>, IngestError> {
    match encoding {
        ContentEncoding::Identity => {
            if body.len() > limit {
                Err(IngestError::BodyTooLarge { limit })
            } else {
                Ok(body.to_vec())
            }
        }
        ContentEncoding::Gzip => {
            read_limited(flate2::read::MultiGzDecoder::new(body), encoding, limit)
        }
        ContentEncoding::Zstd => {
            let decoder = zstd::stream::read::Decoder::with_buffer(body).map_err(|e| {
                IngestError::Decompression {
                    encoding: encoding.name(),
                    reason: e.to_string(),
                }
            })?;
            read_limited(decoder, encoding, limit)
        }
    }
}

/// A decompression done in steps, so that what its output holds can be accounted for
/// before it is produced (request-body admission grows its reservation between steps).
/// The output is held to `limit` bytes as in [`decompress`].
pub(crate) struct Decompressor {
    reader: Box<dyn Read + Send>,
    encoding: ContentEncoding,
    limit: usize,
    out: Vec<u8>,
}

impl Decompressor {
    /// A decompression of `body`, nothing decoded yet.
    pub(crate) fn new(
        body: bytes::Bytes,
        encoding: ContentEncoding,
        limit: usize,
    ) -> Result<Self, IngestError> {
        let input = std::io::Cursor::new(body);
        let reader: Box<dyn Read + Send> = match encoding {
            ContentEncoding::Identity => Box::new(input),
            ContentEncoding::Gzip => Box::new(flate2::read::MultiGzDecoder::new(input)),
            ContentEncoding::Zstd => Box::new(
                zstd::stream::read::Decoder::with_buffer(input).map_err(|e| {
                    IngestError::Decompression {
                        encoding: encoding.name(),
                        reason: e.to_string(),
                    }
                })?,
            ),
        };
        Ok(Decompressor {
            reader,
            encoding,
            limit,
            out: Vec::new(),
        })
    }

    /// Bytes decoded so far.
    pub(crate) fn len(&self) -> usize {
        self.out.len()
    }

    /// Decodes up to `step` more bytes into a buffer grown by exactly that much; answers
    /// whether the input is done. Output past the limit answers
    /// [`IngestError::BodyTooLarge`].
    pub(crate) fn step(&mut self, step: usize) -> Result<bool, IngestError> {
        // One byte past the limit tells "exactly the limit" from "more".
        let room = self.limit.saturating_add(1).saturating_sub(self.out.len());
        let step = step.clamp(1, room.max(1));
        self.out.reserve_exact(step);
        let read = (&mut self.reader)
            .take(step as u64)
            .read_to_end(&mut self.out)
            .map_err(|e| IngestError::Decompression {
                encoding: self.encoding.name(),
                reason: e.to_string(),
            })?;
        if self.out.len() > self.limit {
            return Err(IngestError::BodyTooLarge { limit: self.limit });
        }
        Ok(read < step)
    }

    /// The decoded bytes.
    pub(crate) fn into_output(self) -> Vec<u8> {
        self.out
    }
}

fn read_limited(
    reader: impl Read,
    encoding: ContentEncoding,
    limit: usize,
) -> Result<Vec<u8>, IngestError> {
    let mut out = Vec::new();
    // One byte past the limit tells "exactly the limit" from "more".
    let cap = u64::try_from(limit).unwrap_or(u64::MAX).saturating_add(1);
    reader
        .take(cap)
        .read_to_end(&mut out)
        .map_err(|e| IngestError::Decompression {
            encoding: encoding.name(),
            reason: e.to_string(),
        })?;
    if out.len() > limit {
        return Err(IngestError::BodyTooLarge { limit });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        enc.write_all(data).unwrap();
        enc.finish().unwrap()
    }

    #[test]
    fn gzip_round_trip_and_multi_member() {
        let mut two = gzip(b"{\"a\":1}\n");
        two.extend(gzip(b"{\"a\":2}\n"));
        let out = decompress(&two, ContentEncoding::Gzip, 1 << 20).unwrap();
        assert_eq!(out, b"{\"a\":1}\n{\"a\":2}\n");
    }

    #[test]
    fn bombs_stop_at_the_limit() {
        // 64 MiB of zeros compress to well under 1 MiB; the limit stops them after 16 MiB.
        let zeros = vec![0u8; 64 << 20];
        let bomb = gzip(&zeros);
        assert!(bomb.len() < zeros.len() / 100, "{}", bomb.len());
        assert_eq!(
            decompress(&bomb, ContentEncoding::Gzip, 16 << 20),
            Err(IngestError::BodyTooLarge { limit: 16 << 20 })
        );
        let zbomb = zstd::encode_all(&zeros[..], 1).unwrap();
        assert_eq!(
            decompress(&zbomb, ContentEncoding::Zstd, 16 << 20),
            Err(IngestError::BodyTooLarge { limit: 16 << 20 })
        );
    }

    #[test]
    fn truncated_and_garbage_are_errors() {
        let packed = gzip(&[b'x'; 10_000]);
        let cut = &packed[..packed.len() / 2];
        assert!(matches!(
            decompress(cut, ContentEncoding::Gzip, 1 << 20),
            Err(IngestError::Decompression {
                encoding: "gzip",
                ..
            })
        ));
        let zpacked = zstd::encode_all(&[b'x'; 10_000][..], 3).unwrap();
        assert!(matches!(
            decompress(
                &zpacked[..zpacked.len() - 3],
                ContentEncoding::Zstd,
                1 << 20
            ),
            Err(IngestError::Decompression {
                encoding: "zstd",
                ..
            })
        ));
        assert!(decompress(b"not gzip", ContentEncoding::Gzip, 1 << 20).is_err());
        assert!(decompress(b"not zstd", ContentEncoding::Zstd, 1 << 20).is_err());
    }

    #[test]
    fn encoding_header() {
        assert_eq!(
            ContentEncoding::from_header(None),
            Ok(ContentEncoding::Identity)
        );
        assert_eq!(
            ContentEncoding::from_header(Some("GZIP")),
            Ok(ContentEncoding::Gzip)
        );
        assert_eq!(
            ContentEncoding::from_header(Some("zstd")),
            Ok(ContentEncoding::Zstd)
        );
        assert!(ContentEncoding::from_header(Some("br")).is_err());
    }

    /// Decoding in steps gives what decoding at once gives, refuses past the limit the
    /// same way, and fails the same way on a truncated body.
    #[test]
    fn stepwise_decoding_matches_decoding_at_once() {
        let data: Vec<u8> = (0..100_000u32).flat_map(|i| i.to_le_bytes()).collect();
        let packed = bytes::Bytes::from(gzip(&data));
        for step in [1usize, 7, 4096, 1 << 20] {
            let mut d = Decompressor::new(packed.clone(), ContentEncoding::Gzip, data.len())
                .expect("decoder");
            while !d.step(step).expect("decodes") {}
            assert_eq!(d.into_output(), data);
            let mut small =
                Decompressor::new(packed.clone(), ContentEncoding::Gzip, data.len() - 1)
                    .expect("decoder");
            let refused = loop {
                match small.step(step) {
                    Ok(false) => {}
                    Ok(true) => panic!("decoded past the limit"),
                    Err(e) => break e,
                }
            };
            assert!(matches!(refused, IngestError::BodyTooLarge { .. }));
        }
        let cut = packed.slice(..packed.len() / 2);
        let mut d = Decompressor::new(cut, ContentEncoding::Gzip, data.len()).expect("decoder");
        let failed = loop {
            match d.step(1 << 16) {
                Ok(false) => {}
                Ok(true) => break None,
                Err(e) => break Some(e),
            }
        };
        assert!(matches!(failed, Some(IngestError::Decompression { .. })));
    }
}

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
}

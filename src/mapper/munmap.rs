//! [`MapperError`]'s conversion into the crate's [`Error`].

use super::MapperError;
use crate::Error;

impl From<MapperError> for Error {
    /// The same refusal: [`Error::HugePage`] or [`Error::FrameOutOfRange`],
    /// with the same fields.
    fn from(err: MapperError) -> Error {
        match err {
            MapperError::HugePage { va, size } => Error::HugePage { va, size },
            MapperError::FrameOutOfRange { frame } => Error::FrameOutOfRange { frame },
        }
    }
}

//! Every integration test, in one test binary: DataFusion is linked once, not once per file.
//! Each module is one area; `common` holds the helpers they share.

mod common;

mod bad_input;
mod checkpoints;
mod cli;
mod clients;
mod console;
mod contracts;
mod crash;
mod decoder;
mod durability;
mod evolution;
mod hostile;
mod iceberg;
mod layering;
mod log;
mod metrics;
mod openapi;
mod pressure;
mod process;
mod roundtrip;
mod s3;
mod security;
mod server;
mod sim;
mod slt;
mod streams;
mod subscriptions;
mod table;
mod uploads;

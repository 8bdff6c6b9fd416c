//! Parquet corpora (Hugging Face datasets' `data/*.parquet`), through the `parquet` crate's row
//! API without Arrow: only the columns the document format needs are read, row group by row
//! group, each row turned into the JSON object a jsonl line would be.

use std::path::Path;
use std::sync::atomic::Ordering;

use parquet::file::reader::{FileReader, RowGroupReader, SerializedFileReader};
use parquet::schema::types::Type;

use crate::docs::{doc_of, Doc, DocFormat, DocOpts, BATCH_BYTES, BATCH_DOCS};
use crate::error::DataError;

/// The top-level columns `opts` reads: those it needs, and those it reads where they exist.
fn columns(opts: &DocOpts) -> (Vec<&str>, Vec<&str>) {
    match opts.format {
        DocFormat::Text => (vec![opts.text_field.as_str()], vec![]),
        DocFormat::Chat => (vec!["messages"], vec![]),
        DocFormat::PromptCompletion => (vec!["prompt", "completion"], vec![]),
        DocFormat::Preference => (vec!["chosen", "rejected"], vec!["prompt"]),
        DocFormat::Prompt => (vec!["prompt"], vec![]),
    }
}

fn perr(path: &Path, e: parquet::errors::ParquetError) -> DataError {
    DataError::at(path, format!("not a readable parquet file: {e}"))
}

/// Reads `path`'s documents. The `parquet` crate panics on some corrupt files (e.g. a data
/// page whose dictionary is missing: found by fuzzing, `fuzz/regressions/parquet/`), so a
/// panic while reading is caught and reported as the file's error.
pub(crate) fn read_parquet(
    path: &Path,
    counting: crate::docs::CountingFile,
    opts: &DocOpts,
    f: &mut dyn FnMut(Vec<Doc>) -> Result<(), DataError>,
) -> Result<(), DataError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| read_unguarded(path, counting, opts, f))).unwrap_or_else(|p| {
        let why = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_default();
        Err(DataError::at(path, format!("not a readable parquet file: the parquet reader failed ({why})")))
    })
}

fn read_unguarded(
    path: &Path,
    counting: crate::docs::CountingFile,
    opts: &DocOpts,
    f: &mut dyn FnMut(Vec<Doc>) -> Result<(), DataError>,
) -> Result<(), DataError> {
    let (file, read) = counting.into_parts();
    let reader = SerializedFileReader::new(file).map_err(|e| perr(path, e))?;
    let schema = reader.metadata().file_metadata().schema_descr();
    let fields = schema.root_schema().get_fields();
    let mut picked = Vec::new();
    let (needed, optional) = columns(opts);
    picked.extend(optional.iter().filter_map(|name| fields.iter().find(|t| t.name() == *name).cloned()));
    for name in needed {
        match fields.iter().find(|t| t.name() == name) {
            Some(t) => picked.push(t.clone()),
            None => {
                let have: Vec<&str> = fields.iter().map(|t| t.name()).collect();
                return Err(DataError::at(path, format!("no column `{name}` (columns: {}); set data.text_field or data.format", have.join(", "))));
            }
        }
    }
    if opts.format == DocFormat::Prompt {
        // (Every column: the rewards may read any of them.)
        picked = fields.to_vec();
    }
    let proj = Type::group_type_builder("schema").with_fields(picked).build().map_err(|e| perr(path, e))?;
    let (mut batch, mut bytes, mut row) = (Vec::new(), 0usize, 0u64);
    for g in 0..reader.num_row_groups() {
        let rg: Box<dyn RowGroupReader + '_> = reader.get_row_group(g).map_err(|e| perr(path, e))?;
        let size = rg.metadata().compressed_size().max(0) as u64;
        for r in rg.get_row_iter(Some(proj.clone())).map_err(|e| perr(path, e))? {
            row += 1;
            let r = r.map_err(|e| DataError::at(path, format!("row {row}: cannot decode: {e}")))?;
            let doc = doc_of(&r.to_json_value(), opts).map_err(|m| DataError::at(path, format!("row {row}: {m}")))?;
            bytes += match &doc {
                Doc::Text(t) => t.len(),
                _ => 256,
            };
            batch.push(doc);
            if batch.len() >= BATCH_DOCS || bytes >= BATCH_BYTES {
                f(std::mem::take(&mut batch))?;
                bytes = 0;
            }
        }
        read.fetch_add(size, Ordering::Relaxed);
    }
    if !batch.is_empty() {
        f(batch)?;
    }
    Ok(())
}


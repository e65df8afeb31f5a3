# Install rules and the exported package: `cmake --install <build> --prefix P` puts
#   P/include/terrace/            the public headers (nothing from src/ or tiers/)
#   P/lib/libterrace_*.a          the store, its tiers, common code (and libterrace_model.a)
#   P/bin/terrace                 the CLI (TERRACE_BUILD_CLI)
#   P/lib/cmake/terrace/          terraceConfig.cmake, terraceConfigVersion.cmake, the targets
# so that an engine does find_package(terrace [COMPONENTS model]) and links terrace::terrace
# (terrace::model). The libraries are static: their private dependencies (liburing, RocksDB,
# xxHash, fmt, ...) appear in the link interface and terraceConfig.cmake finds them again.
include(CMakePackageConfigHelpers)
set(TERRACE_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/terrace" CACHE STRING
    "Where terraceConfig.cmake is installed, relative to the prefix")

install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/terrace" DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}"
        COMPONENT terrace_development FILES_MATCHING PATTERN "*.h")

install(TARGETS terrace terrace_common terrace_store terrace_store_core terrace_tier_host terrace_tier_hbm terrace_tier_nvme
        EXPORT terraceTargets
        ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}" COMPONENT terrace_development
        LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}" COMPONENT terrace_runtime
        RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}" COMPONENT terrace_runtime)
install(EXPORT terraceTargets NAMESPACE terrace:: DESTINATION "${TERRACE_INSTALL_CMAKEDIR}"
        COMPONENT terrace_development)

# An optional library installed with its own export set (found with COMPONENTS by terraceConfig.cmake).
function(terrace_install_component target export_set)
  if(TARGET ${target})
    install(TARGETS ${target} EXPORT ${export_set}
            ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}" COMPONENT terrace_development
            LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}" COMPONENT terrace_runtime
            RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}" COMPONENT terrace_runtime)
    install(EXPORT ${export_set} NAMESPACE terrace:: DESTINATION "${TERRACE_INSTALL_CMAKEDIR}"
            COMPONENT terrace_development)
  endif()
endfunction()
terrace_install_component(terrace_model terraceModelTargets)
terrace_install_component(terrace_codec terraceCodecTargets)
terrace_install_component(terrace_kv terraceKvTargets)
terrace_install_component(terrace_experts terraceExpertsTargets)

if(TARGET terrace_cli)
  install(TARGETS terrace_cli RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}" COMPONENT terrace_runtime)
endif()

configure_package_config_file("${CMAKE_CURRENT_LIST_DIR}/terraceConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/terraceConfig.cmake" INSTALL_DESTINATION "${TERRACE_INSTALL_CMAKEDIR}")
# 0.x: a minor version may break the API, so only the same major.minor is compatible.
write_basic_package_version_file("${PROJECT_BINARY_DIR}/terraceConfigVersion.cmake"
  COMPATIBILITY SameMinorVersion)
install(FILES "${PROJECT_BINARY_DIR}/terraceConfig.cmake" "${PROJECT_BINARY_DIR}/terraceConfigVersion.cmake"
        DESTINATION "${TERRACE_INSTALL_CMAKEDIR}" COMPONENT terrace_development)
